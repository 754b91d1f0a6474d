"""Scenes of scikit-learn's digits with their depth: a ground plane whose depth grows from the bottom row (near) to
the top (far), striped at equal steps of its own distance, and 1 to 3 digits standing at random depths, each the size
its depth gives it (nearer is larger), nearer digits covering farther ones. Written as a depth folder:
``images/<split>/*.png`` beside ``depth/<split>/*.npy`` (or 16-bit PNGs of millimetres)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image
from sklearn.datasets import load_digits

NEAR, FAR = 2.0, 10.0


def scenes(n: int, size: int = 64, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """``n`` (image uint8 (H, W, 3), depth float32 (H, W) in metres)."""
    rng = np.random.default_rng(seed)
    data = load_digits()
    rows = np.arange(size, dtype=np.float32)[:, None]
    ground = 1 / (1 / NEAR + (1 / FAR - 1 / NEAR) * (size - 1 - rows) / (size - 1))  # inverse depth linear in rows
    out = []
    for _ in range(n):
        depth = np.repeat(ground, size, axis=1).astype(np.float32)
        image = 60 + 40 * (np.floor(depth * 2) % 2)  # stripes every half metre of the ground
        placed = sorted(rng.uniform(NEAR + 0.5, FAR - 2, size=int(rng.integers(1, 4))), reverse=True)  # far first
        for d in placed:
            s = int(np.clip(round(size * 0.9 * NEAR / d), 8, size - 2))
            k = int(rng.integers(len(data.images)))
            digit = np.asarray(Image.fromarray((data.images[k] * 15).astype(np.uint8)).resize((s, s), Image.BILINEAR))
            x, y = int(rng.integers(0, size - s)), int(rng.integers(0, size - s))
            ink = digit > 60
            image[y:y + s, x:x + s][ink] = 200 + digit[ink] / 255 * 55
            depth[y:y + s, x:x + s][ink] = d
        out.append((np.repeat(image.clip(0, 255).astype(np.uint8)[..., None], 3, axis=2), depth))
    return out


def write_depth_folder(root: Path, splits: dict[str, int], size: int = 64, seed: int = 0,
                       png: bool = False) -> Path:
    """``root/images/<split>/NNNN.png`` beside ``root/depth/<split>/NNNN.npy`` (``png``: 16-bit PNGs of mm)."""
    for j, (split, n) in enumerate(splits.items()):
        (root / "images" / split).mkdir(parents=True, exist_ok=True)
        (root / "depth" / split).mkdir(parents=True, exist_ok=True)
        for i, (image, depth) in enumerate(scenes(n, size, seed + 1000 * j)):
            Image.fromarray(image).save(root / "images" / split / f"{i:04d}.png")
            if png:
                Image.fromarray(np.round(depth * 1000).astype(np.uint16)).save(root / "depth" / split / f"{i:04d}.png")
            else:
                np.save(root / "depth" / split / f"{i:04d}.npy", depth)
    return root
