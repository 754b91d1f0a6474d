"""ImageNet-layout folders: checking a root and its class folders, decoding image files, and a dataset that skips
the files it cannot decode."""

from __future__ import annotations

import copy
import logging
from functools import partial
from io import BytesIO
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor
from torch.utils.data import Dataset
from torchvision.datasets import ImageFolder

from vitkit.errors import MissingFileError, UsageError
from vitkit.image_files import IMAGE_SUFFIXES, image_files, is_image_file

Decoder = Literal["pil", "torchvision"]

log = logging.getLogger(__name__)


def _class_dirs(split_dir: Path) -> list[str]:
    return sorted(d.name for d in split_dir.iterdir() if d.is_dir() and not d.name.startswith("."))


def scan_image_folder(root: Path, train_dir: str = "train", val_dir: str = "val",
                      test_dir: str | None = None) -> list[str]:
    """Check an ImageNet-layout root before any work starts; return the class names.

    ``test_dir`` is checked like the others when that folder exists; it is optional."""
    if not root.is_dir():
        raise MissingFileError(f"ImageFolder root {str(root)!r} does not exist or is not a folder; expected "
                               f"{root}/{train_dir}/<class>/*.jpg and {root}/{val_dir}/<class>/*.jpg")
    for top in {root, root / train_dir, root / val_dir}:
        if (top / "images").is_dir() and (top / "masks").is_dir():
            raise UsageError(f"{top} is a segmentation folder (images/ beside masks/), not class folders: give it to a "
                             "segmentation model (a vitkit.lit.Segmenter checkpoint, or --data "
                             "vitkit.lit.SegmentationDataModule), or a classifier a folder of <class>/<images>")
    splits = {}
    optional = [test_dir] if test_dir and (root / test_dir).is_dir() else []
    for split in (train_dir, val_dir, *optional):
        d = root / split
        if not d.is_dir():
            raise MissingFileError(f"missing {str(d)!r}: expected {root}/{split}/<class>/<images>")
        classes = _class_dirs(d)
        if not classes:
            raise UsageError(f"{str(d)!r} has no class folders: expected {d}/<class>/<images>")
        empty = [c for c in classes if not any(is_image_file(f) for f in (d / c).rglob("*") if f.is_file())]
        if empty:
            raise UsageError(f"class folder(s) without images in {str(d)!r}: {empty} "
                             f"(image extensions: {', '.join(IMAGE_SUFFIXES)})")
        splits[split] = classes
    if splits[train_dir] != splits[val_dir]:
        only_t = sorted(set(splits[train_dir]) - set(splits[val_dir]))
        only_v = sorted(set(splits[val_dir]) - set(splits[train_dir]))
        raise UsageError(f"train and val class folders differ in {str(root)!r}: only in {train_dir}: {only_t}; "
                         f"only in {val_dir}: {only_v}")
    for split in optional:
        if splits[split] != splits[train_dir]:
            raise UsageError(f"{split} class folders differ from {train_dir} in {str(root)!r}: "
                             f"{splits[split]} vs {splits[train_dir]}")
    return splits[train_dir]


def decode(data: bytes, decoder: Decoder = "pil"):
    """Encoded image bytes -> an RGB PIL image (what timm's transforms take).

    ``torchvision`` decodes JPEG with libjpeg-turbo through ``torchvision.io.decode_jpeg`` and everything
    else with PIL; ``pil`` decodes everything with PIL. Raises OSError (or another PIL error) on data that is
    not a readable image."""
    from PIL import Image

    if decoder == "torchvision" and data[:3] == b"\xff\xd8\xff":  # the JPEG start-of-image marker
        from torchvision.io import ImageReadMode, decode_jpeg

        try:
            x = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
        except RuntimeError as e:  # as PIL fails on a damaged file: OSError
            raise OSError(f"cannot decode JPEG data: {e}") from e
        return Image.fromarray(x.permute(1, 2, 0).numpy())  # (H, W, 3) uint8
    from vitkit.image_files import eight_bit

    img = Image.open(BytesIO(data))
    img.load()  # decode now: a truncated file raises here, not later inside a transform
    return eight_bit(img).convert("RGB")


class SkippingImageFolder(Dataset):
    """torchvision's ImageFolder, except that a file that cannot be decoded yields None instead of
    raising, so one corrupt or truncated JPEG (or a non-image with an image extension) cannot end a run."""

    def __init__(self, root: str, transform, decoder: Decoder = "pil") -> None:
        self.folder = ImageFolder(root, transform=transform, loader=partial(_read_image, decoder=decoder))
        self.classes, self.samples = self.folder.classes, self.folder.samples

    def __len__(self) -> int:
        return len(self.folder)

    def with_transform(self, transform) -> SkippingImageFolder:
        """The same files under another transform (the training images as the eval transform shows them)."""
        out = copy.copy(self)
        out.folder = copy.copy(self.folder)
        out.folder.transform = transform
        return out

    def __getitem__(self, i: int):
        try:
            return self.folder[i]
        except (OSError, SyntaxError, ValueError) as e:  # PIL: UnidentifiedImageError, truncated data
            log.debug("skipping unreadable image %s: %s", self.samples[i][0], e)
            return None


def _read_image(path: str, decoder: Decoder):
    with open(path, "rb") as f:
        return decode(f.read(), decoder)


def collate_skipping(items: list) -> tuple[Tensor | None, Tensor | None, int]:
    """Stack the readable samples (their targets: class indices, or multi-hot rows); also return how many were
    skipped (images None if all were)."""
    good = [it for it in items if it is not None]
    if not good:
        return None, None, len(items)
    return torch.stack([x for x, _ in good]), stack_targets([y for _, y in good]), len(items) - len(good)


def stack_targets(ys: list) -> Tensor:
    """Class indices, or multi-hot rows (a multi-label manifest's), as one tensor."""
    return torch.stack(ys) if isinstance(ys[0], Tensor) and ys[0].ndim else torch.tensor([int(v) for v in ys])


def scan_unlabeled(root: Path) -> list[Path]:
    """Every image file under ``root``, at any depth (no class folders needed), sorted; refuses a folder with none."""
    if not root.is_dir():
        raise MissingFileError(f"image folder {str(root)!r} does not exist or is not a folder")
    files = image_files(root)
    if not files:
        raise UsageError(f"no images under {str(root)!r} (looked at every depth for {', '.join(IMAGE_SUFFIXES)})")
    return files


class UnlabeledImages(Dataset):
    """Image files without labels, as (image, 0) for the loaders of labelled data; a file that cannot be decoded
    yields None (skipped and counted, as by :class:`SkippingImageFolder`)."""

    def __init__(self, files: list[Path], transform, decoder: Decoder = "pil") -> None:
        self.files, self.transform, self.decoder = list(files), transform, decoder
        self.samples = [(str(f), 0) for f in self.files]

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        try:
            return self.transform(_read_image(str(self.files[i]), self.decoder)), 0
        except (OSError, SyntaxError, ValueError) as e:
            log.debug("skipping unreadable image %s: %s", self.files[i], e)
            return None
