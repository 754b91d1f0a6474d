"""Detection learned from a real backbone on real digits: RF-DETR (the ``det_finetune_small_data`` recipe: its head
on the frozen features first, then the whole model) fine-tuned from the real DINOv2 ViT-S/14 of ``../shared/real``
on scenes of real MNIST digits, against a baseline on the same frozen features, both scored by the same COCO
evaluation on the same held-out scenes.

Scenes: 1 to 6 digits of 28 to 72 px on a dark square canvas, none overlapping, each box the digit's ink.
Baseline: the frozen backbone's last-layer patch tokens (16 x 16 at 224 px), a logistic regression per patch
(scikit-learn) against the class of the box holding the patch's centre (or background); each class's connected
patches (4-neighbours, scipy) are a box (their extent in pixels) scored by their mean probability.

    python ../shared/real/prepare.py        # once: ~/.cache/vitkit-real/{dino_s14.safetensors,mnist_5k.npz}
    python benchmarks/detection_real.py --out benchmarks/results/detection_real.md
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

REAL = Path.home() / ".cache" / "vitkit-real"


def scenes(digits: np.ndarray, labels: np.ndarray, n: int, size: int, rng: np.random.Generator):
    """``n`` (image uint8 (size, size, 3), boxes (M, 4) corners in pixels around each digit's ink, labels (M,))."""
    out = []
    for _ in range(n):
        canvas = np.zeros((size, size), np.uint8)
        boxes, classes = [], []
        for _ in range(int(rng.integers(1, 7))):
            k, s = int(rng.integers(len(digits))), int(rng.integers(28, 73))
            digit = np.asarray(Image.fromarray(digits[k]).resize((s, s), Image.BILINEAR))
            ys, xs = np.nonzero(digit > 40)
            for _ in range(30):
                x, y = int(rng.integers(0, size - s)), int(rng.integers(0, size - s))
                box = [x + xs.min(), y + ys.min(), x + xs.max() + 1, y + ys.max() + 1]
                if all(box[2] <= b[0] or b[2] <= box[0] or box[3] <= b[1] or b[3] <= box[1] for b in boxes):
                    break
            else:
                continue
            canvas[y:y + s, x:x + s] = np.maximum(canvas[y:y + s, x:x + s], digit)
            boxes.append(box)
            classes.append(int(labels[k]))
        out.append((np.repeat(canvas[..., None], 3, axis=2), np.array(boxes, np.float32).reshape(-1, 4),
                    np.array(classes, np.int64)))
    return out


def write_coco(root: Path, split: str, items) -> None:
    (root / "annotations").mkdir(parents=True, exist_ok=True)
    (root / split).mkdir(exist_ok=True)
    images, annotations = [], []
    for i, (image, boxes, classes) in enumerate(items):
        Image.fromarray(image).save(root / split / f"{i:04d}.png")
        images.append({"id": i, "file_name": f"{i:04d}.png", "height": image.shape[0], "width": image.shape[1]})
        for b, c in zip(boxes.tolist(), classes.tolist(), strict=True):
            annotations.append({"id": len(annotations), "image_id": i, "category_id": c + 1, "iscrowd": 0,
                                "bbox": [b[0], b[1], b[2] - b[0], b[3] - b[1]], "area": (b[2] - b[0]) * (b[3] - b[1])})
    categories = [{"id": c + 1, "name": str(c)} for c in range(10)]
    (root / "annotations" / f"{split}.json").write_text(json.dumps({"images": images, "annotations": annotations,
                                                                    "categories": categories}))


def _tokens(backbone, items, batch: int = 16) -> np.ndarray:
    """The frozen backbone's normed patch tokens (N, h·w, C), as the baseline reads them."""
    mean, std = torch.tensor(backbone.cfg.mean).view(1, 3, 1, 1), torch.tensor(backbone.cfg.std).view(1, 3, 1, 1)
    out = []
    with torch.inference_mode():
        for i in range(0, len(items), batch):
            x = torch.stack([torch.from_numpy(im).permute(2, 0, 1).float() / 255 for im, _, _ in items[i:i + batch]])
            out.append(backbone.forward_features((x - mean) / std)[:, backbone.num_prefix_tokens:].numpy())
    return np.concatenate(out)


def _patch_targets(items, grid: int, patch: int) -> np.ndarray:
    """Per scene and patch, the class of the box holding the patch's centre, 10 where none does."""
    centre = (np.arange(grid) + 0.5) * patch
    out = np.full((len(items), grid, grid), 10, np.int64)
    for i, (_, boxes, classes) in enumerate(items):
        for b, c in zip(boxes, classes, strict=True):
            rows = (centre >= b[1]) & (centre < b[3])
            cols = (centre >= b[0]) & (centre < b[2])
            out[i][np.ix_(rows, cols)] = c
    return out.reshape(len(items), -1)


def baseline(train, val, dino: Path, size: int) -> dict[str, float]:
    """The per-patch logistic regression and connected components (module docstring), scored by COCO's AP."""
    from scipy import ndimage
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    import vitkit
    from vitkit.evaluation.detection import average_precision, scores

    backbone = vitkit.create_model("vit_small_patch14_dinov2", img_size=size, num_classes=0,
                                   checkpoint=str(dino)).eval()
    grid, patch = size // backbone.patch_size, backbone.patch_size
    x_train, x_val = _tokens(backbone, train), _tokens(backbone, val)
    y_train = _patch_targets(train, grid, patch)
    scaler = StandardScaler().fit(x_train.reshape(-1, x_train.shape[-1]))
    probe = LogisticRegression(max_iter=300, C=0.1).fit(scaler.transform(x_train.reshape(-1, x_train.shape[-1])),
                                                        y_train.reshape(-1))
    metric = average_precision()
    for (_, boxes, classes), tokens in zip(val, x_val, strict=True):
        probs = probe.predict_proba(scaler.transform(tokens)).reshape(grid, grid, -1)
        best = probs.argmax(-1)
        found, found_scores, found_labels = [], [], []
        for c in range(10):
            parts, count = ndimage.label(best == c)
            for k in range(1, count + 1):
                ys, xs = np.nonzero(parts == k)
                found.append([xs.min() * patch, ys.min() * patch, (xs.max() + 1) * patch, (ys.max() + 1) * patch])
                found_scores.append(float(probs[ys, xs, c].mean()))
                found_labels.append(c)
        metric.update([{"boxes": torch.tensor(found, dtype=torch.float32).reshape(-1, 4),
                        "scores": torch.tensor(found_scores), "labels": torch.tensor(found_labels, dtype=torch.long)}],
                      [{"boxes": torch.from_numpy(boxes), "labels": torch.from_numpy(classes)}])
    return scores(metric.compute())


def fine_tune(root: Path, dino: Path, size: int, epochs: int, batch: int, run: Path, recipe: str,
              extra: list[str]) -> dict[str, float]:
    """The ``recipe`` from the real backbone, scored by ``vitkit evaluate`` on the held-out scenes."""
    from vitkit.cli import main as vitkit_main

    status = vitkit_main(["train", "fit", "-c", recipe, "--model.checkpoint", str(dino), "--data.root", str(root),
                          "--data.img_size", str(size), "--data.batch_size", str(batch), "--data.hflip", "0",
                          "--data.num_workers", "2", "--trainer.max_epochs", str(epochs), "--trainer.accelerator",
                          "cpu", "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(run),
                          *extra])
    if status != 0:
        raise SystemExit(f"training failed ({status})")
    best = sorted((run / "checkpoints").glob("best-*.ckpt"))[-1]
    status = vitkit_main(["evaluate", "--checkpoint", str(best), "--data.root", str(root), "--split", "val", "-o",
                          str(run / "eval")])
    if status != 0:
        raise SystemExit(f"evaluate failed ({status})")
    return json.loads((run / "eval" / "metrics.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train", type=int, default=300)
    ap.add_argument("--val", type=int, default=100)
    ap.add_argument("--size", type=int, default=224, help="a multiple of 28 (the 14 px patch x 2 windows)")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--recipe", default="det_finetune_small_data")
    ap.add_argument("--head-epochs", type=float, default=None, help="the recipe's head_epochs (default: its own)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    dino, mnist = REAL / "dino_s14.safetensors", REAL / "mnist_5k.npz"
    if not dino.exists() or not mnist.exists():
        raise SystemExit(f"{REAL} lacks the real files: run ../shared/real/prepare.py first")
    data = np.load(mnist)
    rng = np.random.default_rng(args.seed)
    order = rng.permutation(len(data["y"]))  # the file is sorted by class
    first, second = order[:4000], order[4000:]  # the held-out scenes are of digits never trained on
    train = scenes(data["x"][first], data["y"][first], args.train, args.size, rng)
    val = scenes(data["x"][second], data["y"][second], args.val, args.size, rng)
    from vitkit.benchmarking.bench import cpu_name

    cpu = cpu_name()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "scenes"
        write_coco(root, "train", train)
        write_coco(root, "val", val)
        start = time.perf_counter()
        base = baseline(train, val, dino, args.size)
        base_time = time.perf_counter() - start
        start = time.perf_counter()
        extra = [] if args.head_epochs is None else ["--model.recipe.head_epochs", str(args.head_epochs)]
        tuned = fine_tune(root, dino, args.size, args.epochs, args.batch, Path(tmp) / "run", args.recipe, extra)
        tuned_time = time.perf_counter() - start
    rows = [f"CPU: {cpu}, {torch.get_num_threads()} threads; torch {torch.__version__}; {args.train} training and "
            f"{args.val} held-out scenes of real MNIST digits at {args.size} px (seed {args.seed}); the real DINOv2 "
            "ViT-S/14", "",
            "| model | mAP (AP50:95) | AP50 | AP75 | AR100 | wall time |", "|---|---|---|---|---|---|",
            f"| per-patch logistic regression on the frozen tokens, connected components | {base['mAP']:.3f} | "
            f"{base['AP50']:.3f} | {base['AP75']:.3f} | {base['AR100']:.3f} | {base_time:.0f} s |",
            f"| RF-DETR (`{args.recipe}` {' '.join(extra)}), {args.epochs} epochs | {tuned['mAP']:.3f} | "
            f"{tuned['AP50']:.3f} | {tuned['AP75']:.3f} | {tuned['AR100']:.3f} | {tuned_time:.0f} s |"]
    from vitkit.benchmarking.bench import publish

    publish("\n".join(rows), args.out)


if __name__ == "__main__":
    main()
