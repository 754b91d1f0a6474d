"""``SegmentationDataModule``: a folder of images and masks (``vitkit/data/segmentation.py``) for Lightning.
Batches cross to the device as uint8 images and int64 masks; the images are normalised there."""

from __future__ import annotations

from torch import Tensor

from vitkit.data.segmentation import (
    LAYOUT_CLASSES,
    LAYOUT_NAMES,
    LAYOUTS,
    JointTransform,
    MaskFolder,
    OwnSize,
    check_pairs,
    has_split,
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
        self.train_set = MaskFolder(hp.root, "train", train, hp.layout)
        self.val_set = MaskFolder(hp.root, "val", evaluate, hp.layout)
        has_test = has_split(hp.root, "test", hp.layout)
        self.test_set = MaskFolder(hp.root, "test", evaluate, hp.layout) if has_test else None
        for ds in (self.train_set, self.val_set, self.test_set):  # before training: the CLI sets up first
            if ds is not None:
                check_pairs(ds.pairs)

    def eval_view(self, split: str = "train", own_size: bool = False) -> MaskFolder:
        """``split``'s pairs in the evaluation transform (resized, no crop, flip or jitter: what a probe fitted before
        training reads), or with ``own_size`` at each image's own size (batch them one by one)."""
        hp = self.hparams
        transform = OwnSize() if own_size else JointTransform(hp.img_size, False, hp.ignore_index)
        return MaskFolder(hp.root, split, transform, hp.layout)

    def on_after_batch_transfer(self, batch: tuple[Tensor, Tensor], dataloader_idx: int) -> tuple[Tensor, Tensor]:
        x, y = batch
        bad = (y != self.hparams.ignore_index) & ((y < 0) | (y >= self.num_classes))
        if bad.any():
            raise ValueError(f"a mask holds class {int(y[bad][0])}; {self.describe()} has {self.num_classes} classes "
                             f"(0 to {self.num_classes - 1}) and ignore_index {self.hparams.ignore_index}")
        return device_batch(x, self.data_cfg, 0.0), y

    def describe(self) -> str:
        return f"SegmentationDataModule({self.hparams.root})"
