"""A segmentation set of real handwritten digits (scikit-learn's), written as vitkit reads one: images with one or
two digits (of ``DIGITS``) placed on a dark background, and masks with the digit's class + 1 on its strokes
(widened by two pixels), 0 elsewhere."""

from pathlib import Path

import numpy as np
from PIL import Image, ImageFilter
from sklearn.datasets import load_digits

DIGITS = (0, 1, 4)  # three digits that differ in shape: each pixel's class is learnt in a few epochs
CLASSES = ["background", *map(str, DIGITS)]


def write_digit_masks(root: Path, train: int = 300, val: int = 100, size: int = 64, glyph_size: int = 32,
                      seed: int = 0) -> Path:
    """``root/images/{train,val}/*.png`` and ``root/masks/{train,val}/*.png``; train and val draw different
    digits."""
    digits = load_digits()
    rng = np.random.default_rng(seed)
    order = rng.permutation(np.flatnonzero(np.isin(digits.target, DIGITS)))
    pools = {"train": order[: len(order) * 3 // 4], "val": order[len(order) * 3 // 4:]}
    for split, n in (("train", train), ("val", val)):
        (root / "images" / split).mkdir(parents=True, exist_ok=True)
        (root / "masks" / split).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            image = np.zeros((size, size), np.float32)
            mask = np.zeros((size, size), np.uint8)
            for _ in range(rng.integers(1, 3)):
                k = rng.choice(pools[split])
                glyph = Image.fromarray(digits.images[k] / 16).resize((glyph_size, glyph_size), Image.BILINEAR)
                glyph = np.array(glyph)
                top, left = rng.integers(0, size - glyph_size + 1, 2)
                window = image[top:top + glyph_size, left:left + glyph_size]
                np.maximum(window, glyph, out=window)
                ink = np.array(Image.fromarray(glyph > 0.2).filter(ImageFilter.MaxFilter(5)))  # the strokes, widened
                mask[top:top + glyph_size, left:left + glyph_size][ink] = DIGITS.index(digits.target[k]) + 1
            Image.fromarray((image * 255).clip(0, 255).astype(np.uint8)).convert("RGB").save(
                root / "images" / split / f"{i:04d}.png")
            Image.fromarray(mask).save(root / "masks" / split / f"{i:04d}.png")
    return root
