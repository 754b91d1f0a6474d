"""``SegmentationDataModule`` (a folder of images and masks) and ``HFSegmentationDataModule`` (a Hugging Face dataset
with an image and a mask column), over the readers of ``vitkit/data/segmentation.py``, for Lightning. Batches cross
to the device as uint8 images and int64 masks; the images are normalised there."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from vitkit.data.segmentation import (
    LAYOUT_CLASSES,
    LAYOUT_NAMES,
    LAYOUTS,
    HFMaskPairs,
    JointTransform,
    MaskFolder,
    OwnSize,
    check_pairs,
    has_split,
    mask_columns,
)
from vitkit.data.transforms import data_config, device_batch

from .images import _TrainValLoaders


class SegmentationDataModule(_TrainValLoaders):
    """Images with a class index per pixel, from a folder of images and masks.

    ``root/images/{train,val}/NAME.jpg`` beside ``root/masks/{train,val}/NAME.png`` (and ``test`` where the folders
    have it).

    Args:
        root: the folder that holds ``images/`` and ``masks/`` (or the dataset's folder, for another ``layout``).
        num_classes: the classes the masks index (0 to num_classes - 1); other values than ``ignore_index`` are
            refused when a batch holds them. Default: the layout's (ADE20k 150, VOC 21, Cityscapes 19).
        classes: the classes' names, in index order (default: VOC's and Cityscapes' own, else "0", "1", ...).
        layout: ``folder``, ``ade20k``, ``voc`` or ``cityscapes`` (``vitkit/data/segmentation.py``).
        ignore_index: the mask value of pixels no class counts (255, the ADE20k / VOC / Cityscapes convention).
        img_size: the crop the model trains on and the size it evaluates at, one int or (H, W).
        scale: the range of the training resize (the shorter side over ``img_size``), as mmsegmentation's
            ``ratio_range``.
        hflip: the share of training images flipped left-right.
        color_jitter: brightness jitter of the training images (0: none).
        mean, std: normalisation; default the preset's (``model_name``, linked from the model).
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
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
        if not (len(scale) == 2 and 0 < scale[0] <= scale[1]):
            raise ValueError(f"scale must be [low, high] with 0 < low <= high (the training resize over img_size), got "
                             f"{list(scale)}")
        if not 0 <= hflip <= 1 or not 0 <= color_jitter < 1:
            raise ValueError(f"hflip must be in [0, 1] and color_jitter in [0, 1), got {hflip} and {color_jitter}")
        if not 0 <= ignore_index <= 65535:
            raise ValueError(f"ignore_index must be a mask value, 0 to 65535 (255 by default), got {ignore_index}")
        num_classes = LAYOUT_CLASSES.get(layout) if num_classes is None else num_classes
        if num_classes is None or num_classes < 1:
            raise ValueError(f"give --data.num_classes, the classes the masks index (1 or more), got {num_classes}")
        classes = classes if classes is not None else LAYOUT_NAMES.get(layout)
        if classes is not None and len(classes) != num_classes:
            raise ValueError(f"classes names {len(classes)} classes; num_classes is {num_classes}")
        self.num_classes = num_classes
        self.classes = list(classes or map(str, range(num_classes)))
        self.ignore_index = ignore_index
        self.data_cfg = data_config(model_name, img_size, mean=mean, std=std)

    sets_up_locally = True

    def setup(self, stage: str | None = None) -> None:
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
        if check:
            check_pairs(ds.pairs)  # before training: the CLI sets up first
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
            raise ValueError(f"a mask holds class {int(y[bad][0])}; {self.describe()} has {self.num_classes} classes "
                             f"(0 to {self.num_classes - 1}) and ignore_index {self.hparams.ignore_index}")
        return device_batch(x, self.data_cfg, 0.0), y

    def describe(self) -> str:
        return f"SegmentationDataModule({self.hparams.root})"


class HFSegmentationDataModule(SegmentationDataModule):
    """Images with a class index per pixel, from a Hugging Face dataset.

    The hub's cache (offline-first), a ``save_to_disk`` folder, or data files (``vitkit/data/hf.py``), with an image
    column and a mask column.

    Args:
        name: a hub name (``scene_parse_150``, ``segments/sidewalk-semantic``) or a local folder.
        data_files: local parquet or arrow files instead of ``name``.
        config_name, revision: the dataset's configuration and revision.
        image_column, mask_column: the two ``Image`` columns (default: the one named like a mask, ``annotation``,
            ``label``, ``mask``..., and the other).
        num_classes: the classes the masks index (required: a mask column does not say).
        reduce_zero_label: ADE20k's convention in the masks (0 ignored, 1..150 become 0..149).
        train_split, val_split, test_split: the splits' names; without a validation split, ``val_fraction`` of the
            training rows are held out by ``seed``.
        The rest: as :class:`SegmentationDataModule`'s.
    """

    def __init__(self, name: str | None = None, num_classes: int | None = None, classes: list[str] | None = None,
                 data_files: Any = None, config_name: str | None = None, revision: str | None = None,
                 image_column: str | None = None, mask_column: str | None = None, reduce_zero_label: bool = False,
                 train_split: str = "train", val_split: str = "validation", test_split: str | None = "test",
                 val_fraction: float = 0.05, seed: int = 0, ignore_index: int = 255,
                 img_size: int | tuple[int, int] = 224, batch_size: int = 8, num_workers: int | None = None,
                 model_name: str | None = None, scale: tuple[float, float] = (0.5, 2.0), hflip: float = 0.5,
                 color_jitter: float = 0.0, mean: tuple[float, ...] | None = None,
                 std: tuple[float, ...] | None = None, pin_memory: bool = True) -> None:
        from vitkit.data.hf import carve, open_splits

        if num_classes is None:
            raise ValueError("give --data.num_classes, the classes the masks index (a mask column does not say)")
        super().__init__(str(name if name is not None else data_files), num_classes, classes, "folder", ignore_index,
                         img_size, batch_size, num_workers, model_name, scale, hflip, color_jitter, mean, std,
                         pin_memory)
        self.save_hyperparameters()
        self.where = name if name is not None else str(data_files)
        splits, val_split = open_splits(name, data_files, config_name=config_name, revision=revision, streaming=False,
                                        train_split=train_split, val_split=val_split, test_split=test_split,
                                        val_fraction=val_fraction)
        train = splits[train_split]
        self.image_column, self.mask_column = mask_columns(train.features, image_column, mask_column, self.where)
        if val_split in splits:
            self.rows = {"train": train, "val": splits[val_split]}
        else:  # held out of train, the same rows on every rank and run
            keep, held = carve(len(train), val_fraction, seed)
            self.rows = {"train": train.select(keep), "val": train.select(held)}
        if test_split is not None and test_split in splits:
            self.rows["test"] = splits[test_split]

    def split(self, name: str, transform: JointTransform | OwnSize, check: bool = True) -> HFMaskPairs:
        return HFMaskPairs(self.rows[name], self.image_column, self.mask_column, transform,
                           self.hparams.reduce_zero_label, f"{self.where} ({name})")

    def has(self, name: str) -> bool:
        return name in self.rows

    def describe(self) -> str:
        return f"HFSegmentationDataModule({self.where})"
