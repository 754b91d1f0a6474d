"""``SegmentationDataModule`` (a folder of images and masks), ``HFSegmentationDataModule`` (a Hugging Face dataset
with an image and a mask column) and ``StreamingSegmentationDataModule`` (litdata shards of images and masks), over
the readers of ``vitkit/data/segmentation.py``, for Lightning. Batches cross to the device as uint8 images and int64
masks; the images are normalised there."""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor

from vitkit.data.segmentation import (
    LAYOUT_CLASSES,
    LAYOUT_NAMES,
    LAYOUTS,
    HFMaskPairs,
    HFMaskStream,
    JointTransform,
    MaskFolder,
    OwnSize,
    check_pairs,
    classes_in_masks,
    has_split,
    mask_columns,
    mask_pairs,
)
from vitkit.data.transforms import data_config, device_batch
from vitkit.errors import UsageError
from vitkit.models.config import pair

from .loaders import RankPositions, _TrainValLoaders


class SegmentationDataModule(_TrainValLoaders):
    """Images with a class index per pixel, from a folder of images and masks.

    ``root/images/{train,val}/NAME.jpg`` beside ``root/masks/{train,val}/NAME.png`` (and ``test`` where the folders
    have it).

    Args:
        root: the folder that holds ``images/`` and ``masks/`` (or the dataset's folder, for another ``layout``).
        num_classes: the classes the masks index (0 to num_classes - 1); a mask with another value than these and
            ``ignore_index`` is named before training. Default: the layout's (ADE20k 150, VOC 21, Cityscapes 19); for
            a folder, read from the training masks (their largest value other than ``ignore_index``, plus one).
        classes: the classes' names, in index order (default: VOC's and Cityscapes' own, else "0", "1", ...).
        layout: ``folder``, ``ade20k``, ``voc`` or ``cityscapes`` (``vitkit/data/segmentation.py``).
        ignore_index: the mask value of pixels no class counts (255, the ADE20k / VOC / Cityscapes convention).
        img_size: the crop the model trains on and the size it evaluates at, one int or (H, W).
        scale: the range of the training resize (the shorter side over ``img_size``), as mmsegmentation's
            ``ratio_range``.
        hflip: the share of training images flipped left-right.
        color_jitter: brightness jitter of the training images (0: none).
        mean: normalisation's mean; default the preset's (``model_name``, linked from the model).
        std: normalisation's standard deviation, as ``mean``.
    """

    def __init__(self, root: str, num_classes: int | None = None, classes: list[str] | None = None,
                 layout: str = "folder", ignore_index: int = 255,
                 img_size: int | tuple[int, int] = 224, batch_size: int = 8, num_workers: int | None = None,
                 model_name: str | None = None, scale: tuple[float, float] = (0.5, 2.0), hflip: float = 0.5,
                 color_jitter: float = 0.0, mean: tuple[float, ...] | None = None,
                 std: tuple[float, ...] | None = None, pin_memory: bool = True) -> None:
        super().__init__()
        self.save_hyperparameters()
        if layout not in LAYOUTS:
            raise UsageError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
        if not (len(scale) == 2 and 0 < scale[0] <= scale[1]):
            raise UsageError(f"scale must be [low, high] with 0 < low <= high (the training resize over img_size), got "
                             f"{list(scale)}")
        if not 0 <= hflip <= 1 or not 0 <= color_jitter < 1:
            raise UsageError(f"hflip must be in [0, 1] and color_jitter in [0, 1), got {hflip} and {color_jitter}")
        if not 0 <= ignore_index <= 65535:
            raise UsageError(f"ignore_index must be a mask value, 0 to 65535 (255 by default), got {ignore_index}")
        num_classes = LAYOUT_CLASSES.get(layout) if num_classes is None else num_classes
        if num_classes is None and layout == "folder" and self.reads_folder:  # the training masks say
            try:
                num_classes = classes_in_masks(mask_pairs(root, "train"), ignore_index)
            except UsageError as e:
                raise UsageError(f"{e}; the classes are read from its training masks unless --data.num_classes gives "
                                 "them") from None
            rank_zero_info(f"data: {num_classes} classes, read from the masks of {Path(root) / 'masks' / 'train'} "
                           "(--data.num_classes sets them)")
            for hp in (self.hparams, self._hparams_initial):  # what the model is linked to, the checkpoint keeps and
                hp["num_classes"] = num_classes  # the loggers record (Lightning merges the initial with the model's)
        if num_classes is None or num_classes < 1:
            raise UsageError(f"give --data.num_classes, the classes the masks index (1 or more), got {num_classes}")
        classes = classes if classes is not None else LAYOUT_NAMES.get(layout)
        if classes is not None and len(classes) != num_classes:
            raise UsageError(f"classes names {len(classes)} classes; num_classes is {num_classes}")
        self.num_classes = num_classes
        self.classes = list(classes or map(str, range(num_classes)))
        self.ignore_index = ignore_index
        self.data_cfg = data_config(model_name, img_size, mean=mean, std=std)

    sets_up_locally = True
    reads_folder = True  # root is a folder of images and masks (a subclass reads another source)

    def setup(self, stage: str | None = None) -> None:
        if hasattr(self, "train_set"):  # once: the CLI sets up before the trainer, to refuse bad data first
            return
        hp = self.hparams
        train = JointTransform(hp.img_size, True, hp.ignore_index, tuple(hp.scale), hp.hflip, hp.color_jitter)
        evaluate = JointTransform(hp.img_size, False, hp.ignore_index)
        self.train_set, self.val_set = self.split("train", train), self.split("val", evaluate)
        self.test_set = self.split("test", evaluate) if self.has("test") else None

    def split(self, name: str, transform: JointTransform | OwnSize, check: bool = True) -> MaskFolder:
        """The pairs of split ``name`` (train, val or test) through ``transform``; their headers checked first
        (``setup`` checks; another view of a split it set up need not)."""
        hp = self.hparams
        ds = MaskFolder(hp.root, name, transform, hp.layout)
        if check:  # before training: the CLI sets up first
            check_pairs(ds.pairs, self.num_classes, hp.ignore_index, hp.layout)
        return ds

    def has(self, name: str) -> bool:
        return has_split(self.hparams.root, name, self.hparams.layout)

    def eval_view(self, split: str = "train", own_size: bool = False):
        """``split``'s pairs in the evaluation transform (resized, no crop, flip or jitter: what a probe fitted before
        training reads), or with ``own_size`` at each image's own size (batch them one by one)."""
        hp = self.hparams
        view = OwnSize() if own_size else JointTransform(hp.img_size, False, hp.ignore_index)
        return self.split(split, view, check=not hasattr(self, "train_set"))  # checked by setup

    def on_after_batch_transfer(self, batch: tuple[Tensor, Tensor], dataloader_idx: int) -> tuple[Tensor, Tensor]:
        x, y = batch
        bad = (y != self.hparams.ignore_index) & ((y < 0) | (y >= self.num_classes))
        if bad.any():
            raise UsageError(f"a mask holds class {int(y[bad][0])}; {self.describe()} has {self.num_classes} classes "
                             f"(0 to {self.num_classes - 1}) and ignore_index {self.hparams.ignore_index}")
        return device_batch(x, self.data_cfg, 0.0), y

    def describe(self) -> str:
        return f"SegmentationDataModule({self.hparams.root})"


class HFSegmentationDataModule(RankPositions, SegmentationDataModule):
    """Images with a class index per pixel, from a Hugging Face dataset.

    The hub's cache (offline-first), a ``save_to_disk`` folder, or data files (``vitkit/data/hf.py``), with an image
    column and a mask column; map-style, or streamed as :class:`~vitkit.lit.HFDataModule` streams.

    Args:
        name: a hub name (``scene_parse_150``, ``segments/sidewalk-semantic``) or a local folder.
        data_files: local parquet or arrow files instead of ``name``.
        config_name: the dataset's configuration.
        revision: the dataset's revision.
        image_column: the ``Image`` column of the images (default: the one not named like a mask).
        mask_column: the ``Image`` column of the masks (default: the one named like a mask, ``annotation``,
            ``label``, ``mask``...).
        num_classes: the classes the masks index (required: a mask column does not say).
        reduce_zero_label: ADE20k's convention in the masks (0 ignored, 1..150 become 0..149).
        train_split: the training split's name.
        val_split: the validation split's name; without one, ``val_fraction`` of the training rows are held out
            by ``seed``.
        test_split: the test split's name.
        streaming: read the rows as a stream (split by rank and loader worker, the training rows shuffled through
            ``shuffle_buffer`` rows from ``seed`` and the epoch, the same number of steps on every rank, and the
            stream's position in the checkpoint); a stream needs a validation split of its own.

    The other arguments are :class:`SegmentationDataModule`'s.
    """

    def __init__(self, name: str | None = None, num_classes: int | None = None, classes: list[str] | None = None,
                 data_files: Any = None, config_name: str | None = None, revision: str | None = None,
                 image_column: str | None = None, mask_column: str | None = None, reduce_zero_label: bool = False,
                 train_split: str = "train", val_split: str = "validation", test_split: str | None = "test",
                 val_fraction: float = 0.05, seed: int = 0, ignore_index: int = 255,
                 img_size: int | tuple[int, int] = 224, batch_size: int = 8, num_workers: int | None = None,
                 model_name: str | None = None, scale: tuple[float, float] = (0.5, 2.0), hflip: float = 0.5,
                 color_jitter: float = 0.0, mean: tuple[float, ...] | None = None,
                 std: tuple[float, ...] | None = None, pin_memory: bool = True, streaming: bool = False,
                 shuffle_buffer: int = 1000) -> None:
        from vitkit.data.hf import carve, open_splits

        if num_classes is None:
            raise UsageError("give --data.num_classes, the classes the masks index (a mask column does not say)")
        if shuffle_buffer < 1:
            raise UsageError(f"shuffle_buffer must be >= 1 (rows held for shuffling a stream), got {shuffle_buffer}")
        super().__init__(str(name if name is not None else data_files), num_classes, classes, "folder", ignore_index,
                         img_size, batch_size, num_workers, model_name, scale, hflip, color_jitter, mean, std,
                         pin_memory)
        self.save_hyperparameters()
        self.where = name if name is not None else str(data_files)
        splits, val_split = open_splits(name, data_files, config_name=config_name, revision=revision,
                                        streaming=streaming, train_split=train_split, val_split=val_split,
                                        test_split=test_split, val_fraction=val_fraction)
        train = splits[train_split]
        self.image_column, self.mask_column = mask_columns(train.features, image_column, mask_column, self.where)
        if val_split in splits:
            self.rows = {"train": train, "val": splits[val_split]}
        elif streaming:
            raise UsageError(f"{self.where} has no split {val_split!r}, and a stream cannot be carved; name one with "
                             f"--data.val_split (its splits are {', '.join(splits)})")
        else:  # held out of train, the same rows on every rank and run
            keep, held = carve(len(train), val_fraction, seed)
            self.rows = {"train": train.select(keep), "val": train.select(held)}
        if test_split is not None and test_split in splits:
            self.rows["test"] = splits[test_split]

    reads_folder = False

    @property
    def sets_up_locally(self) -> bool:  # a stream is split by rank, which the trainer knows once fit starts
        return not self.hparams.streaming

    @property
    def may_yield_empty(self) -> bool:  # a rank whose part of a stream ended steps on empty batches
        return self.hparams.streaming and self.trainer is not None and self.trainer.world_size > 1

    def split(self, name: str, transform: JointTransform | OwnSize, check: bool = True):
        hp, where = self.hparams, f"{self.where} ({name})"
        if not hp.streaming:
            return HFMaskPairs(self.rows[name], self.image_column, self.mask_column, transform, hp.reduce_zero_label,
                               where)
        from datasets.distributed import split_dataset_by_node

        ds = self.rows[name]
        if isinstance(transform, JointTransform) and transform.train:
            ds = ds.shuffle(seed=hp.seed, buffer_size=hp.shuffle_buffer)
        world, rank = (self.trainer.world_size, self.trainer.global_rank) if self.trainer is not None else (1, 0)
        ds = split_dataset_by_node(ds, rank=rank, world_size=world) if world > 1 else ds
        return HFMaskStream(ds, self.image_column, self.mask_column, transform, hp.reduce_zero_label, where)

    def has(self, name: str) -> bool:
        return name in self.rows

    def check_train_size(self, trainer=None) -> None:
        if not self.hparams.streaming:  # a stream's length is not known before it is read
            super().check_train_size(trainer)

    def loader(self, ds, train: bool):
        if not self.hparams.streaming:
            return super().loader(ds, train)
        from torchdata.stateful_dataloader import StatefulDataLoader

        from .hf import EvenSteps

        hp = self.hparams
        h, w = pair(hp.img_size)  # the batch of a rank whose part ended first: no sample
        empty = (torch.empty(0, 3, h, w, dtype=torch.uint8), torch.empty(0, h, w, dtype=torch.long))
        return EvenSteps(StatefulDataLoader(ds, batch_size=hp.batch_size, num_workers=self.workers(),
                                            pin_memory=hp.pin_memory and torch.cuda.is_available()), self, train,
                         empty)

    def train_dataloader(self):
        if not self.hparams.streaming:
            return super().train_dataloader()
        return self.positioned_train_loader()

    def describe(self) -> str:
        return f"HFSegmentationDataModule({self.where})"


class StreamingSegmentationDataModule(RankPositions, SegmentationDataModule):
    """Images with a class index per pixel, from litdata shards.

    Written by ``vitkit prepare-data ROOT OUT`` from a folder of images and masks (any ``layout``), streamed from a
    local folder or an object-store URL as :class:`~vitkit.lit.StreamingImageDataModule` streams a classifier's
    data: each epoch shuffled from ``seed``, every sample once per epoch across ranks and workers, each sample's
    augmentation its own, and every rank's position in the checkpoint, so ``--ckpt_path last`` continues mid-epoch.

    Args:
        root: the converted dataset (its ``vitkit_dataset.json`` records the layout the masks came in).
        num_classes: the classes the masks index (required unless the layout has them).
        seed: the shuffle's seed.
        cache_dir: where litdata caches a remote dataset.
        max_cache_size: how much of it litdata keeps there.

    The other arguments are :class:`SegmentationDataModule`'s.
    """

    def __init__(self, root: str, num_classes: int | None = None, classes: list[str] | None = None, seed: int = 0,
                 cache_dir: str | None = None, max_cache_size: str = "100GB", ignore_index: int = 255,
                 img_size: int | tuple[int, int] = 224, batch_size: int = 8, num_workers: int | None = None,
                 model_name: str | None = None, scale: tuple[float, float] = (0.5, 2.0), hflip: float = 0.5,
                 color_jitter: float = 0.0, mean: tuple[float, ...] | None = None,
                 std: tuple[float, ...] | None = None, pin_memory: bool = True) -> None:
        from vitkit.data.shards import read_dataset_info

        where = root if "://" in root else str(Path(os.path.expanduser(root)).resolve())
        self.info = read_dataset_info(where)
        if not self.info.get("masks"):
            raise UsageError(f"{root} holds images with class labels, not masks: stream it with "
                             "--data vitkit.lit.StreamingImageDataModule")
        self.info.setdefault("layout", "folder")  # a marker that does not say: the folder layout's masks
        super().__init__(where, num_classes, classes, self.info["layout"], ignore_index, img_size, batch_size,
                         num_workers, model_name, scale, hflip, color_jitter, mean, std, pin_memory)
        self.save_hyperparameters()

    sets_up_locally = False  # the index of a remote dataset is read when the loaders are made
    reads_folder = False

    def split(self, name: str, transform: JointTransform | OwnSize, check: bool = True):
        from vitkit.data.streaming import MaskShards

        hp = self.hparams
        shuffle = isinstance(transform, JointTransform) and transform.train  # the training view alone
        return MaskShards(f"{hp.root.rstrip('/')}/{name}", transform, shuffle=shuffle, seed=hp.seed,
                          reduce_zero=self.info["layout"] == "ade20k", cache_dir=hp.cache_dir,
                          max_cache_size=hp.max_cache_size)

    def has(self, name: str) -> bool:
        return name in self.info["splits"]

    def loader(self, ds, train: bool):
        from litdata import StreamingDataLoader

        hp = self.hparams
        return StreamingDataLoader(ds, batch_size=hp.batch_size, num_workers=self.workers(),
                                   generator=torch.Generator().manual_seed(hp.seed),
                                   pin_memory=hp.pin_memory and torch.cuda.is_available())

    def train_dataloader(self):
        from vitkit.data.streaming import EvenBatches

        self.check_train_size()
        h, w = pair(self.hparams.img_size)  # the padding of a rank that ran out: a batch of no sample
        empty = (torch.empty(0, 3, h, w, dtype=torch.uint8), torch.empty(0, h, w, dtype=torch.long))
        previous, self._train_loader = self._train_loader, EvenBatches(
            partial(self.loader, self.train_set, True), self.info["splits"]["train"]["samples"], empty)
        if previous is not None:
            self._train_loader.loader.current_epoch = previous.loader.current_epoch
        if self._resume is not None:
            self._restore_train_loader()
        return self._train_loader

    @property
    def may_yield_empty(self) -> bool:  # a rank that ran out of the epoch's samples steps on an empty batch
        return self.trainer is not None and self.trainer.world_size > 1

    def describe(self) -> str:
        return f"StreamingSegmentationDataModule({self.hparams.root})"
