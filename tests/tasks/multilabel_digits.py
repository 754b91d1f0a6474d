"""A multi-label image set made of real digits: each 32 px image holds one to three different handwritten digits
(scikit-learn's) in the cells of a 2 x 2 grid, and its labels are the digits it shows. Training and validation
images are drawn from different halves of the digits, so validation shows handwriting the model never saw."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
from PIL import Image
from sklearn.datasets import load_digits

CELL = 16


def _image(rng: np.random.Generator, pool: dict[int, np.ndarray], digits) -> tuple[np.ndarray, list[int]]:
    k = int(rng.integers(1, 4))
    labels = sorted(rng.choice(10, size=k, replace=False).tolist())
    cells = rng.choice(4, size=k, replace=False)
    canvas = np.zeros((2 * CELL, 2 * CELL), dtype=np.uint8)
    for label, cell in zip(labels, cells, strict=True):
        i = int(rng.choice(pool[label]))
        glyph = Image.fromarray((digits.images[i] * 15).astype(np.uint8)).resize((CELL, CELL), Image.BILINEAR)
        r, c = divmod(int(cell), 2)
        canvas[r * CELL:(r + 1) * CELL, c * CELL:(c + 1) * CELL] = np.asarray(glyph)
    return canvas, labels


def write_multi_digits(root: Path, train: int = 600, val: int = 200, seed: int = 0,
                       fmt: str = "csv") -> tuple[Path, Path]:
    """PNG files under ``root/images`` and two manifests, ``train.csv`` and ``val.csv`` (or ``.jsonl`` with
    ``fmt="jsonl"``), whose ``labels`` name the digits of each image, space-separated."""
    digits = load_digits()
    rng = np.random.default_rng(seed)
    half = len(digits.target) // 2
    (root / "images").mkdir(parents=True, exist_ok=True)
    out = []
    for split, count, lo, hi in (("train", train, 0, half), ("val", val, half, len(digits.target))):
        pool = {d: np.flatnonzero(digits.target[lo:hi] == d) + lo for d in range(10)}
        rows = []
        for n in range(count):
            canvas, labels = _image(rng, pool, digits)
            name = f"images/{split}_{n:05d}.png"
            Image.fromarray(canvas).convert("RGB").save(root / name)
            rows.append((name, [str(d) for d in labels]))
        path = root / f"{split}.{fmt}"
        if fmt == "jsonl":
            path.write_text("".join(json.dumps({"image": name, "labels": labels}) + "\n" for name, labels in rows))
        else:
            with open(path, "w", newline="") as f:
                w = csv.writer(f)
                w.writerow(["image", "labels"])
                w.writerows([(name, " ".join(labels)) for name, labels in rows])
        out.append(path)
    return out[0], out[1]
