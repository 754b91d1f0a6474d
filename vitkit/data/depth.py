"""Images with depth maps: ``root/images/<split>/x.jpg`` beside ``root/depth/<split>/x.<png|npy|tif|tiff>`` (NYU
Depth v2's and KITTI's exports as people keep them), read as an image (``tv_tensors.Image``, uint8) and a depth map
(``tv_tensors.Mask``, float32 metres or the file's unit) so that torchvision's v2 transforms move both alike.

* 16-bit PNG: the integers divided by ``png_scale`` (1000: millimetres, NYU's; 256: KITTI's).
* ``.npy``: a 2-D float array; ``.tif``/``.tiff``: a float image (PIL mode ``F``).
* A split may instead be a list file (the BTS / AdaBins / ZoeDepth split files of NYU Depth v2 and KITTI's Eigen
  split): a line per image, ``image depth [focal ...]``, the image relative to the root and the depth map to
  ``depth_root``; a line whose depth is ``None`` (KITTI's frames without ground truth) is left out and counted.
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
from torch import Tensor
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
    return to_depth(np.asarray(depth, dtype=np.float32), png_scale, str(path))


def to_depth(value, png_scale: float = 1000.0, where: str = "a depth map") -> tuple[np.ndarray, int]:
    """A depth value as a dataset row holds it (a PIL image: 16- or 32-bit integers divided by ``png_scale``, or
    floats; an array or nested list of floats) -> (depth (H, W) float32, 0 where there is no measurement; the count of
    negative or non-finite values)."""
    from PIL import Image

    if isinstance(value, Image.Image):
        if value.mode in ("I;16", "I;16B", "I"):
            depth = np.asarray(value, dtype=np.float32) / png_scale
        elif value.mode == "F":
            depth = np.asarray(value, dtype=np.float32)
        else:
            raise UsageError(f"{where} is a {value.mode} image; a depth image holds one channel of 16 or 32 bits "
                             "(integers divided by --data.png_scale) or floats")
    else:
        try:
            depth = np.asarray(value, dtype=np.float32)
        except (TypeError, ValueError) as e:
            raise UsageError(f"{where} is not a depth map ({type(value).__name__}: {e})") from None
    if depth.ndim == 3 and depth.shape[-1] == 1:
        depth = depth[..., 0]
    if depth.ndim != 2:
        raise UsageError(f"{where}: a depth map is one value per pixel (H, W), got shape {depth.shape}")
    bad = ~np.isfinite(depth) | (depth < 0)
    if bad.any():
        log.warning("%s: %d negative or non-finite value(s), left out as no measurement", where, int(bad.sum()))
    return np.where(bad, 0, depth).astype(np.float32), int(bad.sum())


def list_pairs(root: str | os.PathLike, listing: str | os.PathLike,
               depth_root: str | os.PathLike | None = None) -> list[tuple[Path, Path]]:
    """(image, depth map) of a split file (module docstring): ``image depth [focal ...]`` per line, the image under
    ``root``, the depth map under ``depth_root`` (default ``root``); lines whose depth is ``None`` left out."""
    root = Path(root)
    listing = Path(listing) if Path(listing).is_absolute() else root / listing
    if not listing.is_file():
        raise MissingFileError(f"{listing} is not there: a split file lists 'image depth' per line")
    base = Path(depth_root) if depth_root is not None else root
    pairs, without = [], 0
    for n, line in enumerate(listing.read_text().splitlines(), 1):
        fields = line.split()
        if not fields:
            continue
        if len(fields) < 2:
            raise UsageError(f"{listing}:{n}: expected 'image depth [focal]', got {line.strip()!r}")
        if fields[1] == "None":
            without += 1
            continue
        image, depth = root / fields[0].lstrip("/"), base / fields[1].lstrip("/")
        for path in (image, depth):
            if not path.is_file():
                raise MissingFileError(f"{listing}:{n}: {path} is not there (images are read under --data.root "
                                       f"{root}, depth maps under --data.depth_root {base})")
        pairs.append((image, depth))
    if without:
        log.info("%s: %d line(s) without a depth map (None) left out", listing, without)
    if not pairs:
        raise MissingFileError(f"{listing} lists no image with a depth map")
    return pairs


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


def paired(pixels: Tensor, depth: np.ndarray, depth_where: str, image_where: str, transform):
    """An image (``tv_tensors.Image``) and its depth map as one sample, through ``transform`` where given; a map of
    another size refused by name."""
    if depth.shape != tuple(pixels.shape[-2:]):
        raise UsageError(f"{depth_where} is {depth.shape[0]}x{depth.shape[1]} and its image {image_where} "
                         f"{pixels.shape[-2]}x{pixels.shape[-1]}: a depth map has its image's size")
    target = tv_tensors.Mask(torch.from_numpy(depth))
    return transform(pixels, target) if transform is not None else (pixels, target)


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
        return paired(pixels, depth, str(depth_path), str(path), self.transform)


class DepthRows(Dataset):
    """The rows of a Hugging Face dataset with an image and a depth column, as :class:`DepthImages` gives pairs."""

    def __init__(self, rows, image_column: str, depth_column: str, png_scale: float = 1000.0,
                 transform=None) -> None:
        self.rows, self.image_column, self.depth_column = rows, image_column, depth_column
        self.png_scale, self.transform = png_scale, transform

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int):
        row = self.rows[i]
        pixels = tv_tensors.Image(TF.pil_to_tensor(row[self.image_column].convert("RGB")))
        depth, _ = to_depth(row[self.depth_column], self.png_scale, f"row {i}'s {self.depth_column!r}")
        return paired(pixels, depth, f"row {i}'s {self.depth_column!r}", repr(self.image_column), self.transform)
