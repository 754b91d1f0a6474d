"""Images with a class index per pixel: the folder layout, its pairs, and transforms that move image and mask
together (random scale, crop and flip for training; a resize for evaluation), up to a uint8 image and an int64
mask. The image is normalised on the device, as classifiers' batches are.

Layouts (``LAYOUTS``):

* ``folder``: ``root/images/<split>/<name>.<jpg|png|...>`` beside ``root/masks/<split>/<name>.png``, a mask holding
  the class index of each pixel (a single-channel or palette PNG) and ``ignore_index`` (255) where no class counts;
* ``ade20k``: ADEChallengeData2016 (``images/{training,validation}/*.jpg``, ``annotations/...*.png``): 150 classes
  stored as 1-150 with 0 for "other", read as 0-149 with 0 -> 255 (mmsegmentation's ``reduce_zero_label``);
* ``voc``: Pascal VOC 2012 (``JPEGImages/``, ``SegmentationClass/`` palette PNGs, the split's names in
  ``ImageSets/Segmentation/<split>.txt``): 21 classes, 255 on object borders;
* ``cityscapes``: ``leftImg8bit/<split>/<city>/*_leftImg8bit.png`` beside
  ``gtFine/<split>/<city>/*_gtFine_labelTrainIds.png`` (cityscapesscripts' 19 training classes, 255 elsewhere).

The split names are vitkit's (train, val, test); ADE20k's folders are training and validation.
"""

from __future__ import annotations

import io
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from torch.utils.data import Dataset, IterableDataset

from vitkit.errors import UsageError
from vitkit.image_files import IMAGE_SUFFIXES, is_image_file
from vitkit.models.config import pair

from .hf import StreamPosition

LAYOUTS = ("folder", "ade20k", "voc", "cityscapes")
LAYOUT_CLASSES = {"ade20k": 150, "voc": 21, "cityscapes": 19}
VOC_CLASSES = ["background", "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow",
               "diningtable", "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa", "train",
               "tvmonitor"]
CITYSCAPES_CLASSES = ["road", "sidewalk", "building", "wall", "fence", "pole", "traffic light", "traffic sign",
                      "vegetation", "terrain", "sky", "person", "rider", "car", "truck", "bus", "train", "motorcycle",
                      "bicycle"]
LAYOUT_NAMES = {"voc": VOC_CLASSES, "cityscapes": CITYSCAPES_CLASSES}


def _paired(images: list[Path], mask_of, where: Path) -> list[tuple[Path, Path]]:
    pairs = []
    for image in images:
        mask = mask_of(image)
        if not mask.is_file():
            raise UsageError(f"{image} has no mask: expected {mask}")
        pairs.append((image, mask))
    if not pairs:
        raise UsageError(f"{where} holds no images ({', '.join(IMAGE_SUFFIXES)})")
    return pairs


def _folder(root: Path, split: str) -> list[tuple[Path, Path]]:
    images, masks = root / "images" / split, root / "masks" / split
    if not images.is_dir():
        raise UsageError(f"{images} is not a folder: segmentation data is root/images/<split>/NAME.jpg beside "
                         f"root/masks/<split>/NAME.png (split: {split}), or --data.layout ade20k, voc or cityscapes")
    files = sorted(p for p in images.iterdir() if is_image_file(p))
    return _paired(files, lambda image: masks / f"{image.stem}.png", images)


def _ade20k(root: Path, split: str) -> list[tuple[Path, Path]]:
    folder = {"train": "training", "val": "validation"}.get(split, split)
    images = root / "images" / folder
    if not images.is_dir():
        raise UsageError(f"{images} is not a folder: ADE20k is ADEChallengeData2016/images/{{training,validation}} "
                         "beside annotations/ (--data.root is the ADEChallengeData2016 folder)")
    files = sorted(p for p in images.iterdir() if is_image_file(p))
    return _paired(files, lambda image: root / "annotations" / folder / f"{image.stem}.png", images)


def _voc(root: Path, split: str) -> list[tuple[Path, Path]]:
    listing = root / "ImageSets" / "Segmentation" / f"{split}.txt"
    if not listing.is_file():
        raise UsageError(f"{listing} is not there: Pascal VOC is VOC2012/ImageSets/Segmentation/<split>.txt beside "
                         "JPEGImages/ and SegmentationClass/ (--data.root is the VOC2012 folder)")
    names = [line.strip() for line in listing.read_text().splitlines() if line.strip()]
    return _paired([root / "JPEGImages" / f"{n}.jpg" for n in names],
                   lambda image: root / "SegmentationClass" / f"{image.stem}.png", listing)


def _cityscapes(root: Path, split: str) -> list[tuple[Path, Path]]:
    images = root / "leftImg8bit" / split
    if not images.is_dir():
        raise UsageError(f"{images} is not a folder: Cityscapes is leftImg8bit/<split>/<city>/ beside gtFine/ "
                         "(--data.root is the folder that holds both)")
    files = sorted(images.glob("*/*_leftImg8bit.png"))

    def mask_of(image: Path) -> Path:
        stem = image.name.removesuffix("_leftImg8bit.png")
        return root / "gtFine" / split / image.parent.name / f"{stem}_gtFine_labelTrainIds.png"

    return _paired(files, mask_of, images)


def mask_pairs(root: str | Path, split: str, layout: str = "folder") -> list[tuple[Path, Path]]:
    """(image, mask) of every image of ``split`` in ``layout``, in name order; a missing mask is named."""
    if layout not in LAYOUTS:
        raise UsageError(f"--data.layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    return {"folder": _folder, "ade20k": _ade20k, "voc": _voc, "cityscapes": _cityscapes}[layout](Path(root), split)


def has_split(root: str | Path, split: str, layout: str) -> bool:
    """Whether ``split`` is there in ``layout`` (a test split is optional)."""
    root = Path(root)
    return {"folder": root / "images" / split, "ade20k": root / "images" / split,
            "voc": root / "ImageSets" / "Segmentation" / f"{split}.txt",
            "cityscapes": root / "leftImg8bit" / split}[layout].exists()


MASK_MODES = ("L", "P", "I", "I;16")  # the pixel's value is its class index


def read_mask(path: Path) -> Image.Image:
    """A mask PNG as class indices (mode ``L``, ``P`` or ``I;16``: the index is the pixel's value, not a colour)."""
    mask = Image.open(path)
    if mask.mode not in MASK_MODES:
        raise UsageError(f"{path} is a {mask.mode} image; a mask holds one class index per pixel (a single-channel "
                         "or palette PNG): map each colour of a colour mask to its class index and save the indices "
                         "(PIL: Image.fromarray(indices.astype('uint8')).save(path))")
    return mask


def check_pairs(pairs: list[tuple[Path, Path]], num_classes: int | None = None, ignore_index: int = 255,
                layout: str = "folder") -> None:
    """Every pair, before training: an image PIL cannot open, a mask that is not class indices, a mask of another size
    than its image, or (given ``num_classes``) a mask value that is neither a class nor ``ignore_index`` is named with
    its file."""
    for image_path, mask_path in pairs:
        try:
            with Image.open(image_path) as image, Image.open(mask_path) as mask:
                if mask.mode not in MASK_MODES:
                    read_mask(mask_path)  # its one-line refusal
                if image.size != mask.size:
                    raise UsageError(f"{mask_path} is {mask.size[0]}x{mask.size[1]}, its image {image_path} "
                                     f"{image.size[0]}x{image.size[1]}: a mask has its image's size")
                if num_classes is None:
                    continue
                values = mask_values(mask, layout)
                bad = values[(values != ignore_index) & (values >= num_classes)]
                if len(bad):
                    raise UsageError(f"{mask_path} holds class {int(bad.max())}; --data.num_classes is {num_classes} "
                                     f"(classes 0 to {num_classes - 1}, and {ignore_index} where no class counts, "
                                     "--data.ignore_index)")
        except OSError as e:
            raise UsageError(f"cannot read {image_path} or its mask {mask_path}: {e}") from None


def mask_values(mask: Image.Image, layout: str = "folder") -> np.ndarray:
    """The distinct values of a mask, as the layout reads them (ADE20k's one lower, 0 ignored)."""
    values = np.unique(np.asarray(mask))
    if layout == "ade20k":
        values = np.where(values == 0, 255, values - 1)
    return values


def classes_in_masks(pairs: list[tuple[Path, Path]], ignore_index: int = 255, layout: str = "folder") -> int:
    """The classes a split's masks index: the largest value other than ``ignore_index``, plus one."""
    top = -1
    for _, mask_path in pairs:
        values = mask_values(read_mask(mask_path), layout)
        values = values[values != ignore_index]
        top = max(top, int(values.max()) if len(values) else -1)
    if top < 0:
        raise UsageError(f"the masks beside {pairs[0][1].parent} hold no class, only {ignore_index} (ignore_index)")
    return top + 1


class JointTransform:
    """Image and mask through the same geometry. Training: the shorter side resized to ``img_size`` x a factor drawn
    from ``scale``, padded (image 0, mask ``ignore_index``) to at least ``img_size``, a random crop of ``img_size``,
    a horizontal flip with ``hflip``, and colour jitter of strength ``color_jitter`` on the image only. Evaluation:
    both resized to ``img_size`` (bilinear, nearest)."""

    def __init__(self, img_size: int | tuple[int, int], train: bool, ignore_index: int = 255,
                 scale: tuple[float, float] = (0.5, 2.0), hflip: float = 0.5, color_jitter: float = 0.0) -> None:
        self.size = pair(img_size)
        self.train, self.ignore_index = train, ignore_index
        self.scale, self.hflip, self.color_jitter = scale, hflip, color_jitter

    def __call__(self, image: Image.Image, mask: Image.Image, rng=random) -> tuple[Tensor, Tensor]:
        h, w = self.size
        if image.size != mask.size:
            raise UsageError(f"an image of {image.size[0]}x{image.size[1]} has a mask of {mask.size[0]}x{mask.size[1]}")
        if not self.train:
            return _uint8(image.resize((w, h), Image.BILINEAR)), _indices(mask.resize((w, h), Image.NEAREST))
        s = rng.uniform(*self.scale) * min(h, w) / min(image.size)
        size = (max(1, round(image.size[0] * s)), max(1, round(image.size[1] * s)))
        x, y = _uint8(image.resize(size, Image.BILINEAR)), _indices(mask.resize(size, Image.NEAREST))
        pad_h, pad_w = max(0, h - x.shape[1]), max(0, w - x.shape[2])
        if pad_h or pad_w:
            x = torch.nn.functional.pad(x, (0, pad_w, 0, pad_h), value=0)
            y = torch.nn.functional.pad(y, (0, pad_w, 0, pad_h), value=self.ignore_index)
        top, left = rng.randint(0, x.shape[1] - h), rng.randint(0, x.shape[2] - w)
        x, y = x[:, top:top + h, left:left + w], y[top:top + h, left:left + w]
        if rng.random() < self.hflip:
            x, y = x.flip(-1), y.flip(-1)
        if self.color_jitter:
            gain = 1 + rng.uniform(-self.color_jitter, self.color_jitter)
            x = (x.float() * gain).clamp(0, 255).to(torch.uint8)
        return x.contiguous(), y.contiguous()


class OwnSize:
    """Image and mask as they are, at their own size: what scoring at each image's size reads."""

    def __call__(self, image: Image.Image, mask: Image.Image, rng=random) -> tuple[Tensor, Tensor]:
        if image.size != mask.size:
            raise UsageError(f"an image of {image.size[0]}x{image.size[1]} has a mask of {mask.size[0]}x{mask.size[1]}")
        return _uint8(image), _indices(mask)


def _uint8(image: Image.Image) -> Tensor:
    from vitkit.image_files import eight_bit

    return torch.from_numpy(np.array(eight_bit(image).convert("RGB"), dtype=np.uint8)).permute(2, 0, 1).contiguous()


def _indices(mask: Image.Image) -> Tensor:
    return torch.from_numpy(np.array(mask, dtype=np.int64))


def reduce_zero_label(mask: Image.Image) -> Image.Image:
    """ADE20k's masks: 0 ("other") -> 255, every class one lower (1-150 -> 0-149)."""
    values = np.array(mask, dtype=np.int64)
    return Image.fromarray(np.where(values == 0, 255, values - 1).astype(np.uint8))


class MaskFolder(Dataset):
    """The (image, mask) pairs of one split: (uint8 (3, H, W), int64 (H, W)) after ``transform``, which draws from
    Python's generator (seeded per loader worker by PyTorch, as torchvision's transforms draw from torch's)."""

    def __init__(self, root: str | Path, split: str, transform: JointTransform | OwnSize,
                 layout: str = "folder") -> None:
        self.pairs, self.transform, self.layout = mask_pairs(root, split, layout), transform, layout

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        image_path, mask_path = self.pairs[i]
        try:
            image = Image.open(image_path)
            image.load()
        except OSError as e:
            raise UsageError(f"{image_path} is not an image PIL can read ({e})") from None
        mask = read_mask(mask_path)
        return self.transform(image, reduce_zero_label(mask) if self.layout == "ade20k" else mask, random)


# -- a Hugging Face dataset with an image column and a mask column -------------------------------------------------

MASK_NAMES = ("mask", "label", "annotation", "segment", "semantic", "gt", "target")  # how hubs name a mask column


def mask_columns(features, image_column: str | None, mask_column: str | None, where: str) -> tuple[str, str]:
    """The image column and the mask column, both ``Image`` features: named, or told apart by the mask's name (one
    holding ``mask``, ``label``, ``annotation``, ``segment``...); an error names the columns there are."""
    import datasets

    columns = ", ".join(f"{k} ({type(v).__name__})" for k, v in (features or {}).items())
    for arg, col in (("image_column", image_column), ("mask_column", mask_column)):
        if col is not None and col not in (features or {}):
            raise UsageError(f"{where}: --data.{arg} {col!r} is not a column; its columns are {columns}")
    images = [k for k, v in (features or {}).items() if isinstance(v, datasets.Image)]
    if mask_column is None:
        named = [k for k in images if k != image_column and any(n in k.lower() for n in MASK_NAMES)]
        if len(named) != 1:
            raise UsageError(f"{where}: which column holds the masks? Its columns are {columns}; name it with "
                             "--data.mask_column (and the images' with --data.image_column)")
        mask_column = named[0]
    if image_column is None:
        others = [k for k in images if k != mask_column]
        if len(others) != 1:
            raise UsageError(f"{where}: which column holds the images? Its columns are {columns}; name it with "
                             "--data.image_column")
        image_column = others[0]
    for arg, col in (("image_column", image_column), ("mask_column", mask_column)):
        if not isinstance(features[col], datasets.Image):
            raise UsageError(f"{where}: --data.{arg} {col!r} is {type(features[col]).__name__}, not images; its "
                             f"columns are {columns}")
    return image_column, mask_column


def _pil(value: Any) -> Image.Image:
    """An undecoded ``Image`` value (bytes and/or a path) as the PIL image it encodes, its mode kept."""
    data, path = (value.get("bytes"), value.get("path")) if isinstance(value, dict) else (value, None)
    image = Image.open(io.BytesIO(data) if data is not None else path)
    image.load()
    return image


class _MaskRows:
    """Rows of a Hugging Face dataset's image and mask columns as (image, mask) pairs after ``transform``, as
    :class:`MaskFolder` gives them; ``reduce_zero`` reads ADE20k's convention (0 ignored, the rest one lower)."""

    def __init__(self, ds, image_column: str, mask_column: str, transform, reduce_zero: bool = False,
                 where: str = "the dataset") -> None:
        import datasets

        self.ds = ds.select_columns([image_column, mask_column]).cast_column(image_column, datasets.Image(
            decode=False)).cast_column(mask_column, datasets.Image(decode=False))
        self.image_column, self.mask_column, self.transform = image_column, mask_column, transform
        self.reduce_zero, self.where = reduce_zero, where

    def pair(self, row: dict, i: int) -> tuple[Tensor, Tensor]:
        """Row ``i``'s image and mask through the transform; a row that is not an image and its mask is named."""
        try:
            image, mask = _pil(row[self.image_column]).convert("RGB"), _pil(row[self.mask_column])
        except OSError as e:
            raise UsageError(f"{self.where}: row {i} does not hold a readable image and mask ({e})") from None
        if mask.mode not in MASK_MODES:
            raise UsageError(f"{self.where}: the mask of row {i} is a {mask.mode} image; a mask holds one class index "
                             "per pixel (a single-channel or palette PNG)")
        if image.size != mask.size:
            raise UsageError(f"{self.where}: row {i} has an image of {image.size[0]}x{image.size[1]} and a mask of "
                             f"{mask.size[0]}x{mask.size[1]}: a mask has its image's size")
        return self.transform(image, reduce_zero_label(mask) if self.reduce_zero else mask, random)


class HFMaskPairs(_MaskRows, Dataset):
    """A map-style split of a Hugging Face dataset as (image, mask) pairs."""

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.pair(self.ds[int(i)], i)


class HFMaskStream(_MaskRows, StreamPosition, IterableDataset):
    """A streamed split of a Hugging Face dataset as (image, mask) pairs (rows counted from 0 in this rank's part),
    its position the stream's."""

    def __iter__(self):
        for i, row in enumerate(self.ds):
            yield self.pair(row, i)
