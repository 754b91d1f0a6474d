"""Real digits composed into multi-label images, and the baseline a multi-label recipe must beat on them.

From the 5,000 real MNIST digits that ``../shared/real/prepare.py`` writes (``~/.cache/vitkit-real/mnist_5k.npz``):
each 56 x 56 image holds one to four different digits on a 2 x 2 grid of 28 px cells, and its labels are the digits
it shows; training and validation images draw on disjoint halves of each digit's scans. Writes ``OUT/images``,
``OUT/train.csv`` and ``OUT/val.csv`` (vitkit's manifests) and prints the macro mAP of one logistic regression per
class on the images' standardised raw pixels. The recipes then run on the manifests, for example:

    python benchmarks/multilabel_real.py /tmp/ml --train 2000 --val 500
    vitkit train fit -c vit_tiny_digits --data vitkit.lit.ManifestDataModule --data.train_manifest /tmp/ml/train.csv \\
        --data.val_manifest /tmp/ml/val.csv --data.img_size 32 --model.labels MultiLabel
    vitkit train fit -c finetune_small_data --model.checkpoint ~/.cache/vitkit-real/dino_s14.safetensors \\
        --data vitkit.lit.ManifestDataModule --data.train_manifest /tmp/ml/train.csv \\
        --data.val_manifest /tmp/ml/val.csv --data.img_size 98 --model.labels MultiLabel
"""

from __future__ import annotations

import argparse
import csv
import os
from pathlib import Path

import numpy as np
from PIL import Image


def compose(out: Path, train: int, val: int, seed: int = 0) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    data = np.load(os.path.expanduser("~/.cache/vitkit-real/mnist_5k.npz"))
    x, y = data["x"], data["y"]
    rng = np.random.default_rng(seed)
    (out / "images").mkdir(parents=True, exist_ok=True)
    arrays = {}
    for split, count, half in (("train", train, 0), ("val", val, 1)):
        pool = {d: np.array_split(np.flatnonzero(y == d), 2)[half] for d in range(10)}
        rows, pixels, targets = [], [], []
        for i in range(count):
            labels = sorted(rng.choice(10, int(rng.integers(1, 5)), replace=False).tolist())
            canvas = np.zeros((56, 56), np.uint8)
            for label, cell in zip(labels, rng.choice(4, len(labels), replace=False), strict=True):
                r, c = divmod(int(cell), 2)
                canvas[r * 28:(r + 1) * 28, c * 28:(c + 1) * 28] = x[rng.choice(pool[label])]
            name = f"images/{split}_{i:05d}.png"
            Image.fromarray(canvas).convert("RGB").save(out / name)
            rows.append((name, " ".join(map(str, labels))))
            pixels.append(canvas.ravel() / 255.0)
            targets.append([float(d in labels) for d in range(10)])
        with open(out / f"{split}.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["image", "labels"])
            writer.writerows(rows)
        arrays[split] = (np.array(pixels, np.float32), np.array(targets))
    return arrays


def pixels_baseline(arrays: dict[str, tuple[np.ndarray, np.ndarray]]) -> float:
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import average_precision_score
    from sklearn.preprocessing import StandardScaler

    (xt, yt), (xv, yv) = arrays["train"], arrays["val"]
    scale = StandardScaler().fit(xt)
    p = np.stack([LogisticRegression(max_iter=3000).fit(scale.transform(xt), yt[:, j])
                  .predict_proba(scale.transform(xv))[:, 1] for j in range(yt.shape[1])], 1)
    return float(average_precision_score(yv, p, average="macro"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--train", type=int, default=2000)
    ap.add_argument("--val", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    arrays = compose(args.out, args.train, args.val, args.seed)
    print(f"{args.out}: {args.train} training and {args.val} validation images; a logistic regression on the "
          f"pixels: val mAP {pixels_baseline(arrays):.4f}")


if __name__ == "__main__":
    main()
