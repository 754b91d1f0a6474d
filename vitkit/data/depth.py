"""Images with depth maps: ``root/images/<split>/x.jpg`` beside ``root/depth/<split>/x.<png|npy|tif|tiff>`` (NYU
Depth v2's and KITTI's exports as people keep them), read as an image (``tv_tensors.Image``, uint8) and a depth map
(``tv_tensors.Mask``, float32 metres or the file's unit) so that torchvision's v2 transforms move both alike.

* 16-bit PNG: the integers divided by ``png_scale`` (1000: millimetres, NYU's; 256: KITTI's).
* ``.npy``: a 2-D float array; ``.tif``/``.tiff``: a float image (PIL mode ``F``).
* 0, a negative value, NaN or inf is no measurement (KITTI's sparse maps hold 0 where the lidar saw nothing): kept as
  0, which every loss and score leaves out (:func:`vitkit.evaluation.depth.valid_mask`); a file with negative or
  non-finite values is named in a warning with their count.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset
from torchvision import tv_tensors
from torchvision.transforms.v2 import functional as TF

from vitkit.errors import MissingFileError, UsageError
from vitkit.image_files import image_files

DEPTH_SUFFIXES = (".png", ".npy", ".tif", ".tiff")
log = logging.getLogger(__name__)


def read_depth(path: str | os.PathLike, png_scale: float = 1000.0) -> tuple[np.ndarray, int]:
    """(depth (H, W) float32 with 0 where there is no measurement, the count of negative or non-finite values)."""
    path = Path(path)
    suffix = path.suffix.lower()
    try:
        if suffix == ".npy":
            depth = np.load(path, allow_pickle=False)
        elif suffix in (".png", ".tif", ".tiff"):
            from PIL import Image

            with Image.open(path) as image:
                if suffix == ".png" and image.mode not in ("I;16", "I;16B", "I"):
                    raise UsageError(f"{path} is a {image.mode} PNG; a depth PNG holds one channel of 16 bits (the "
                                     "depth times --data.png_scale)")
                depth = np.asarray(image, dtype=np.float32)
            if suffix == ".png":
                depth = depth / png_scale
        else:
            got = suffix or "a file without a suffix"
            raise UsageError(f"{path}: a depth map is a 16-bit PNG, a .npy array or a float TIFF, not {got}")
    except UsageError:
        raise
    except (OSError, ValueError) as e:
        raise UsageError(f"{path} cannot be read as a depth map ({type(e).__name__}: {str(e)[:120]})") from None
    depth = np.asarray(depth, dtype=np.float32)
    if depth.ndim == 3 and depth.shape[-1] == 1:
        depth = depth[..., 0]
    if depth.ndim != 2:
        raise UsageError(f"{path}: a depth map is one value per pixel (H, W), got shape {depth.shape}")
    bad = ~np.isfinite(depth) | (depth < 0)
    if bad.any():
        log.warning("%s: %d negative or non-finite value(s), left out as no measurement", path, int(bad.sum()))
    return np.where(bad, 0, depth).astype(np.float32), int(bad.sum())


def depth_pairs(root: str | os.PathLike, split: str) -> list[tuple[Path, Path]]:
    """(image, depth map) of ``root/images/<split>/`` beside ``root/depth/<split>/`` by stem (sub-folders kept)."""
    root = Path(root)
    images, maps = root / "images" / split, root / "depth" / split
    for folder in (images, maps):
        if not folder.is_dir():
            raise MissingFileError(f"{folder} is not there: a depth folder holds images/{split}/ beside "
                                   f"depth/{split}/ (a depth map per image, same name, .png, .npy or .tiff)")
    found: dict[Path, Path] = {}
    for p in sorted(maps.rglob("*")):
        if p.suffix.lower() in DEPTH_SUFFIXES:
            stem = p.relative_to(maps).with_suffix("")
            if stem in found:
                raise UsageError(f"{found[stem]} and {p}: two depth maps of one name; keep one per image")
            found[stem] = p
    pairs, missing = [], []
    for image in image_files(images):
        depth = found.get(image.relative_to(images).with_suffix(""))
        (pairs.append((image, depth)) if depth is not None else missing.append(image))
    if missing:
        raise MissingFileError(f"{missing[0]} has no depth map in {maps} (a .png, .npy or .tiff of its name); "
                               f"{len(missing)} image(s) of {images} have none")
    if not pairs:
        raise MissingFileError(f"{images} holds no images")
    return pairs


class DepthImages(Dataset):
    """The (image, depth map) pairs of a split, through ``transform(image, depth)`` where given; a depth map of
    another size than its image is refused by name."""

    def __init__(self, pairs: list[tuple[Path, Path]], png_scale: float = 1000.0, transform=None) -> None:
        self.pairs, self.png_scale, self.transform = pairs, png_scale, transform

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int):
        from PIL import Image

        path, depth_path = self.pairs[i]
        with Image.open(path) as image:
            pixels = tv_tensors.Image(TF.pil_to_tensor(image.convert("RGB")))
        depth, _ = read_depth(depth_path, self.png_scale)
        if depth.shape != tuple(pixels.shape[-2:]):
            raise UsageError(f"{depth_path} is {depth.shape[0]}x{depth.shape[1]} and its image {path} "
                             f"{pixels.shape[-2]}x{pixels.shape[-1]}: a depth map has its image's size")
        target = tv_tensors.Mask(torch.from_numpy(depth))
        return self.transform(pixels, target) if self.transform is not None else (pixels, target)
