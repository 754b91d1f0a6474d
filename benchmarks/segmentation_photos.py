"""Real photos as a segmentation set: scikit-image's brick, grass and gravel photographs composed into mosaics.

Each image is a Voronoi mosaic of two to five cells around random seeds, every cell filled with a crop of one of the
three photographs (random flips), and its mask holds the photograph's index in each pixel; the images of a split hold
at least two textures each. Training and validation crops come from disjoint halves of each photograph (top and
bottom), so validation scores textures on parts of the photographs no training image showed. Writes
``OUT/images/{train,val}`` and ``OUT/masks/{train,val}`` (``SegmentationDataModule``'s folder layout) and prints the
share of pixels of each class and the mIoU of predicting the largest class everywhere. The recipes then run on it,
for example with the real DINOv2 ViT-S/14 that ``../shared/real/prepare.py`` writes:

    python benchmarks/segmentation_photos.py /tmp/textures --train 200 --val 100 --size 112
    vitkit train fit -c seg_linear_probe --model.checkpoint ~/.cache/vitkit-real/dino_s14.safetensors \\
        --data.root /tmp/textures --data.num_classes 3 --data.img_size 112 --trainer.max_epochs 10
    vitkit train fit -c seg_finetune_small_data --model.checkpoint ~/.cache/vitkit-real/dino_s14.safetensors \\
        --data.root /tmp/textures --data.num_classes 3 --data.img_size 112 --trainer.max_epochs 6

``seg_finetune_small_data`` logs the per-pixel logistic regression on the frozen patch features (the probe it starts
from) as ``val/probe_baseline``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image

TEXTURES = ("brick", "grass", "gravel")


def compose(out: Path, train: int, val: int, size: int = 112, seed: int = 0) -> dict[str, np.ndarray]:
    """Write the mosaics; returns each split's masks (N, size, size)."""
    import skimage.data

    photos = [getattr(skimage.data, name)() for name in TEXTURES]
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size]
    masks = {}
    for split, count, half in (("train", train, 0), ("val", val, 1)):
        (out / "images" / split).mkdir(parents=True, exist_ok=True)
        (out / "masks" / split).mkdir(parents=True, exist_ok=True)
        written = []
        for i in range(count):
            cells = int(rng.integers(2, 6))
            seeds = rng.uniform(0, size, (cells, 2))
            classes = rng.integers(0, len(TEXTURES), cells)
            classes[rng.choice(cells, 2, replace=False)] = rng.choice(len(TEXTURES), 2, replace=False)  # two at least
            nearest = np.argmin((yy[None] - seeds[:, 0, None, None]) ** 2 + (xx[None] - seeds[:, 1, None, None]) ** 2,
                                axis=0)
            mask = classes[nearest].astype(np.uint8)
            image = np.zeros((size, size), np.uint8)
            for k in range(len(TEXTURES)):
                photo = photos[k][half * 256:(half + 1) * 256]  # this split's half of the photograph
                top, left = rng.integers(0, photo.shape[0] - size + 1), rng.integers(0, photo.shape[1] - size + 1)
                crop = photo[top:top + size, left:left + size]
                crop = crop[::-1] if rng.random() < 0.5 else crop
                crop = crop[:, ::-1] if rng.random() < 0.5 else crop
                image[mask == k] = crop[mask == k]
            Image.fromarray(image).convert("RGB").save(out / "images" / split / f"{i:05d}.png")
            Image.fromarray(mask).save(out / "masks" / split / f"{i:05d}.png")
            written.append(mask)
        masks[split] = np.stack(written)
    return masks


def majority_miou(masks: dict[str, np.ndarray]) -> float:
    """The mIoU on validation of predicting the training set's largest class at every pixel."""
    top = int(np.bincount(masks["train"].ravel(), minlength=len(TEXTURES)).argmax())
    label = masks["val"].ravel()
    ious = [((label == k) & (k == top)).sum() / max(1, ((label == k) | (k == top)).sum())
            for k in range(len(TEXTURES)) if (label == k).any() or k == top]
    return float(np.mean(ious))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--train", type=int, default=200)
    ap.add_argument("--val", type=int, default=100)
    ap.add_argument("--size", type=int, default=112, help="image side (112: 8 x 8 patches of 14 px)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.size > 256:
        raise SystemExit(f"error: --size is at most 256 (half of a 512 px photograph), got {args.size}")
    masks = compose(args.out, args.train, args.val, args.size, args.seed)
    shares = np.bincount(masks["val"].ravel(), minlength=len(TEXTURES)) / masks["val"].size
    print(f"wrote {args.train} training and {args.val} validation mosaics of {args.size} px to {args.out}")
    print("validation pixels: " + ", ".join(f"{t} {s:.3f}" for t, s in zip(TEXTURES, shares, strict=True)))
    print(f"the largest class everywhere: val mIoU {majority_miou(masks):.4f}")


if __name__ == "__main__":
    main()
