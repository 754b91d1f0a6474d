"""Images with depth maps for training and scoring a depth model (``vitkit.data.depth`` reads them).

Training images and their maps are cropped, resized and flipped together by torchvision's v2 transforms (the map as
a ``tv_tensors.Mask``: nearest, so a missing measurement never blends into a neighbour's) to the square the model
takes, and stacked. Evaluation images are resized to that square alone; their maps stay at their own size, where the
model's output is resized to be scored (as Depth Anything's evaluation does). Batches cross to the device as uint8."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torchvision.transforms import v2

from vitkit.data.depth import DepthImages, DepthRows, depth_pairs, list_pairs
from vitkit.data.transforms import data_config, device_batch
from vitkit.errors import MissingFileError, UsageError

from .loaders import _TrainValLoaders


class DepthTransform:
    """(image, depth map) -> the model's square: in training a crop of ``scale`` of the area at an aspect from 3/4 to
    4/3 (all of it at ``scale`` (1, 1)), resized, flipped with ``hflip``; in evaluation the image resized alone."""

    def __init__(self, size: int, train: bool, hflip: float = 0.5, scale: tuple[float, float] = (1.0, 1.0)) -> None:
        self.train, self.size = train, size
        resize = v2.Resize((size, size), antialias=True) if tuple(scale) == (1.0, 1.0) else \
            v2.RandomResizedCrop((size, size), scale=tuple(scale), antialias=True)
        self.pipeline = v2.Compose([resize, v2.RandomHorizontalFlip(hflip)]) if train else \
            v2.Resize((size, size), antialias=True)

    def __call__(self, image, depth) -> tuple[Tensor, Tensor]:
        if self.train:
            image, depth = self.pipeline(image, depth)
        else:
            image = self.pipeline(image)
        return image.as_subclass(Tensor), depth.as_subclass(Tensor)


def collate_depth(samples: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor | list[Tensor]]:
    """Images stacked; maps stacked where they share a size (training's), else a list (evaluation's own sizes)."""
    images, maps = zip(*samples, strict=True)
    same = len({tuple(m.shape) for m in maps}) == 1
    return torch.stack(images), torch.stack(maps) if same else list(maps)


class DepthDataModule(_TrainValLoaders):
    """Images with a depth map each, from a folder of ``images/`` beside ``depth/``.

    Each split is ``images/<split>/`` beside ``depth/<split>/``, a map per image of its name (16-bit PNG, ``.npy``
    or float TIFF); or a split file (a name ending ``.txt``: NYU's and KITTI's split files as BTS, AdaBins and
    ZoeDepth read them, ``image depth [focal]`` per line, images under ``root``, maps under ``depth_root``).

    Args:
        root: the dataset's folder.
        train: the training split's name, or its split file.
        val: the validation split's name, or its split file.
        test: the test split's name (or split file), where the folder has one.
        depth_root: where a split file's depth maps are (default: ``root``; KITTI's annotated depth is usually a
            folder of its own).
        png_scale: what a 16-bit PNG's integers are divided by (1000: millimetres, NYU's; 256: KITTI's).
        max_depth: the deepest measurement that counts (NYU: 10, KITTI: 80); deeper pixels are left out of the loss
            and the scores. None: every positive depth.
        img_size: the square the images are resized to.
        batch_size: images per batch (per device).
        hflip: the share of training images flipped left-right.
        scale: the training crop's share of the image's area, [low, high] (1, 1: the whole image).
        num_workers: loader workers per device (None: what the machine has).
        model_name: the model whose mean and std normalise the images (``mean``/``std`` override).
    """

    def __init__(self, root: str, train: str = "train", val: str = "val", test: str | None = "test",
                 depth_root: str | None = None, png_scale: float = 1000.0, max_depth: float | None = None,
                 img_size: int = 518, batch_size: int = 8, hflip: float = 0.5, scale: tuple[float, float] = (1.0, 1.0),
                 num_workers: int | None = None, model_name: str | None = None,
                 mean: tuple[float, ...] | None = None, std: tuple[float, ...] | None = None,
                 pin_memory: bool = True) -> None:
        super().__init__()
        self.save_hyperparameters()
        if not isinstance(img_size, int) or isinstance(img_size, bool) or img_size < 1:
            raise UsageError(f"img_size must be one whole number of pixels (the square the images are resized to), "
                             f"got {img_size!r}")
        if not 0 <= hflip <= 1 or not (len(scale) == 2 and 0 < scale[0] <= scale[1] <= 1):
            raise UsageError(f"hflip must be in [0, 1] and scale [low, high] with 0 < low <= high <= 1, got {hflip} "
                             f"and {list(scale)}")
        if not png_scale > 0 or (max_depth is not None and not max_depth > 0):
            raise UsageError(f"png_scale and max_depth must be positive, got {png_scale} and {max_depth}")
        self.root = Path(root).expanduser()
        if not self.root.is_dir():
            raise MissingFileError(f"--data.root {root} is not a folder")
        self.data_cfg = data_config(model_name, img_size, mean=mean, std=std)
        self.max_depth = max_depth

    sets_up_locally = True
    collate_fn = staticmethod(collate_depth)

    def has(self, name: str | None) -> bool:
        if name is not None and name.endswith(".txt"):
            return (self.root / name).is_file() or Path(name).is_file()
        return name is not None and (self.root / "images" / name).is_dir()

    def split(self, name: str, train: bool = False) -> DepthImages:
        hp = self.hparams
        pairs = list_pairs(self.root, name, hp.depth_root) if name.endswith(".txt") else depth_pairs(self.root, name)
        return DepthImages(pairs, hp.png_scale, DepthTransform(hp.img_size, train, hp.hflip, tuple(hp.scale)))

    def setup(self, stage: str | None = None) -> None:
        if hasattr(self, "val_set"):
            return
        hp = self.hparams
        if stage in (None, "fit") or self.has(hp.train):
            self.train_set = self.split(hp.train, True)
        self.val_set = self.split(hp.val)
        self.test_set = self.split(hp.test) if self.has(hp.test) else None
        rank_zero_info(f"data: {self.describe()}: {len(getattr(self, 'train_set', []))} training and "
                       f"{len(self.val_set)} validation images with depth maps")

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        x, depth = batch
        return device_batch(x, self.data_cfg, 0.0), depth

    def describe(self) -> str:
        return f"DepthDataModule({self.root})"


class HFDepthDataModule(DepthDataModule):
    """Images with depth maps from a Hugging Face dataset (an image column and a depth column).

    The depth is a 16-bit or float image, or an array, as NYU Depth v2's copies on the hub hold it.

    Args:
        name: a hub name (offline-first: the cache answers before the network) or a local folder (``save_to_disk``'s,
            or data files).
        data_files: local parquet or arrow files instead of ``name``.
        config_name: the dataset's configuration.
        revision: the dataset's revision.
        image_column: the image column.
        depth_column: the depth column (integers are divided by ``png_scale``; floats are the depth).
        train_split: the training split's name.
        val_split: the validation split's name; without one, ``val_fraction`` of the training rows are held out
            by ``seed``.
        test_split: the test split's name, where the dataset has one.

    The other arguments are :class:`DepthDataModule`'s.
    """

    def __init__(self, name: str | None = None, data_files: Any = None, config_name: str | None = None,
                 revision: str | None = None, image_column: str = "image", depth_column: str = "depth_map",
                 train_split: str = "train", val_split: str = "validation", test_split: str | None = "test",
                 val_fraction: float = 0.1, seed: int = 0, png_scale: float = 1000.0, max_depth: float | None = None,
                 img_size: int = 518, batch_size: int = 8, hflip: float = 0.5,
                 scale: tuple[float, float] = (1.0, 1.0), num_workers: int | None = None,
                 model_name: str | None = None, mean: tuple[float, ...] | None = None,
                 std: tuple[float, ...] | None = None, pin_memory: bool = True) -> None:
        from vitkit.data.hf import split_rows

        super(DepthDataModule, self).__init__()  # the loaders' base, not a folder's reading
        self.save_hyperparameters()
        if not isinstance(img_size, int) or isinstance(img_size, bool) or img_size < 1:
            raise UsageError(f"img_size must be one whole number of pixels, got {img_size!r}")
        if not 0 <= hflip <= 1 or not (len(scale) == 2 and 0 < scale[0] <= scale[1] <= 1):
            raise UsageError(f"hflip must be in [0, 1] and scale [low, high] with 0 < low <= high <= 1, got {hflip} "
                             f"and {list(scale)}")
        if not png_scale > 0 or (max_depth is not None and not max_depth > 0):
            raise UsageError(f"png_scale and max_depth must be positive, got {png_scale} and {max_depth}")
        self.where = str(name if name is not None else data_files)
        self.rows = split_rows(name, data_files, config_name=config_name, revision=revision,
                               train_split=train_split, val_split=val_split, test_split=test_split,
                               val_fraction=val_fraction, seed=seed,
                               columns={image_column: "--data.image_column", depth_column: "--data.depth_column"})
        self.data_cfg = data_config(model_name, img_size, mean=mean, std=std)
        self.max_depth = max_depth

    def has(self, name: str | None) -> bool:
        return name in self.rows

    def split(self, name: str, train: bool = False) -> DepthRows:
        hp = self.hparams
        return DepthRows(self.rows[name], hp.image_column, hp.depth_column, hp.png_scale,
                         DepthTransform(hp.img_size, train, hp.hflip, tuple(hp.scale)))

    def setup(self, stage: str | None = None) -> None:
        if hasattr(self, "val_set"):
            return
        if stage in (None, "fit"):
            self.train_set = self.split("train", True)
        self.val_set = self.split("val")
        self.test_set = self.split("test") if self.has("test") else None
        rank_zero_info(f"data: {self.describe()}: {len(getattr(self, 'train_set', []))} training and "
                       f"{len(self.val_set)} validation rows with depth maps")

    def describe(self) -> str:
        return f"HFDepthDataModule({self.where})"
