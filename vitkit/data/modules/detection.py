"""``DetectionDataModule``: images with boxes from a COCO or a YOLO folder (the readers of
``vitkit/data/detection.py``), for Lightning. Every image is letterboxed to the model's square size (its longer side
resized to ``img_size``, the shorter in proportion, the rest padded at the right and bottom:
``models.detection.to_pixels`` maps a box back to the image's own pixels). The boxes move with the image through
``torchvision.transforms.v2`` (``tv_tensors.BoundingBoxes``): no box geometry is written here.

A batch crosses to the device as uint8 images (B, 3, S, S) and one target per image: ``boxes`` (M, 4: centre x,
centre y, width, height relative to the input), ``labels`` (M,), ``iscrowd`` (M,; crowd regions are kept for COCO's
evaluation, which ignores detections on them, and left out of the loss) and ``size`` (the image's own height and
width)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torchvision import tv_tensors
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF
from torchvision.transforms.v2._utils import query_size

from vitkit.data.detection import VOC_CLASSES, DetectionImages, HFDetectionImages, coco, voc, yolo, yolo_names
from vitkit.data.transforms import data_config, device_batch
from vitkit.errors import MissingFileError, UsageError
from vitkit.models.detection import letterbox_size

from .loaders import _TrainValLoaders

LAYOUTS = ("auto", "coco", "yolo", "voc")


class Letterbox(v2.Transform):
    """An image (and its boxes) resized to its longer side ``size``, the shorter in proportion
    (``models.detection.letterbox_size``), then padded at the right and bottom to ``size`` x ``size``."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def make_params(self, flat_inputs: list[Any]) -> dict[str, Any]:
        h, w = query_size(flat_inputs)
        nh, nw = letterbox_size(h, w, self.size)
        return {"resized": [nh, nw], "padding": [0, 0, self.size - nw, self.size - nh]}

    def transform(self, inpt: Any, params: dict[str, Any]) -> Any:
        inpt = self._call_kernel(TF.resize, inpt, size=params["resized"], antialias=True)
        return self._call_kernel(TF.pad, inpt, padding=params["padding"], fill=0)


def labels_and_crowd(inputs: Any) -> tuple[Tensor, Tensor]:
    """What ``SanitizeBoundingBoxes`` drops with a box: its label and its crowd flag (a function, not a lambda, so
    that the transform pickles into loader workers)."""
    target = inputs[1]
    return target["labels"], target["iscrowd"]


class BoxTransform:
    """A sample (image, target with corner boxes in pixels) as the model reads it: augmented (``train``), letterboxed
    to ``size``, its boxes relative to the input and the image's own size kept."""

    def __init__(self, size: int, train: bool, hflip: float = 0.5, scale: tuple[float, float] = (1.0, 1.0)) -> None:
        steps: list[v2.Transform] = []
        if train and scale[1] > 1:  # half the images zoomed out onto a canvas up to scale[1] times larger
            steps.append(v2.RandomZoomOut(side_range=(1.0, scale[1]), p=0.5))
        if train and scale[0] < 1:  # a crop down to scale[0] of the image that keeps objects (SSD's)
            steps.append(v2.RandomIoUCrop(min_scale=scale[0]))
        if train and hflip:
            steps.append(v2.RandomHorizontalFlip(hflip))
        steps += [Letterbox(size), v2.SanitizeBoundingBoxes(labels_getter=labels_and_crowd)]
        self.size, self.steps = size, v2.Compose(steps)

    def __call__(self, image: tv_tensors.Image, target: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        h, w = image.shape[-2:]
        image, target = self.steps(image, target)
        boxes = TF.convert_bounding_box_format(target["boxes"], new_format=tv_tensors.BoundingBoxFormat.CXCYWH)
        return image.as_subclass(Tensor), {
            "boxes": boxes.as_subclass(Tensor).float() / self.size, "labels": target["labels"],
            "iscrowd": target["iscrowd"], "size": torch.tensor([h, w])}


def collate_boxes(samples: list[tuple[Tensor, dict[str, Tensor]]]) -> tuple[Tensor, list[dict[str, Tensor]]]:
    return torch.stack([s[0] for s in samples]), [s[1] for s in samples]


def find_layout(root: Path, split: str) -> tuple[str, Path, Path | None]:
    """(layout, the split's images, its COCO annotation file) of a folder: COCO with ``annotations/<split>.json`` or
    ``annotations/instances_<split>.json`` over ``<split>/``, or Roboflow's ``<split>/_annotations.coco.json`` beside
    its images; YOLO with ``images/<split>/`` and ``labels/<split>/``; Pascal VOC with ``ImageSets/Main/<split>.txt``
    (a VOCdevkit's ``VOC2012/`` folder)."""
    for ann in (root / "annotations" / f"{split}.json", root / "annotations" / f"instances_{split}.json",
                root / split / "_annotations.coco.json"):
        if ann.is_file():
            return "coco", root / split, ann
    if (root / "images" / split).is_dir():
        return "yolo", root / "images" / split, None
    if (root / "ImageSets" / "Main" / f"{split}.txt").is_file():
        return "voc", root / "JPEGImages", None
    raise MissingFileError(
        f"{root} holds no {split} split of a layout vitkit reads: COCO (annotations/{split}.json or "
        f"annotations/instances_{split}.json over {split}/, or {split}/_annotations.coco.json), YOLO "
        f"(images/{split}/ with labels/{split}/ and a data.yaml naming the classes) or Pascal VOC "
        f"(ImageSets/Main/{split}.txt, Annotations/, JPEGImages/)")


def check_settings(img_size: Any, hflip: float, scale: tuple[float, float]) -> None:
    if not isinstance(img_size, int) or isinstance(img_size, bool) or img_size < 1:
        raise UsageError(f"img_size must be one whole number of pixels (the letterbox's square), got {img_size!r}")
    if not 0 <= hflip <= 1 or not (len(scale) == 2 and 0 < scale[0] <= 1 <= scale[1]):
        raise UsageError(f"hflip must be in [0, 1] and scale [low, high] with 0 < low <= 1 <= high, got {hflip} and "
                         f"{list(scale)}")


class DetectionDataModule(_TrainValLoaders):
    """Images with boxes, from a COCO or a YOLO folder.

    Args:
        root: the dataset's folder: COCO (``annotations/train.json`` or ``annotations/instances_train.json`` over
            ``train/``, or Roboflow's export, ``train/_annotations.coco.json`` beside the images), YOLO
            (Ultralytics': ``images/train/`` beside ``labels/train/`` and ``data.yaml``) or Pascal VOC (a
            ``VOC2012/`` folder: ``ImageSets/Main/train.txt``, ``Annotations/``, ``JPEGImages/``).
        layout: ``auto`` (by what ``root`` holds), ``coco``, ``yolo`` or ``voc``.
        train: the training split's name (``train2017`` for COCO's own folders).
        val: the validation split's name.
        test: the test split's name, where the folder has one.
        names: a YOLO folder's class names, in index order (default: its data YAML's ``names``); a VOC folder's
            (default: VOC's 20).
        img_size: the square the images are letterboxed to.
        batch_size: images per batch (per device).
        hflip: the share of training images flipped left-right.
        scale: the training zoom: ``[low, high]``, a crop down to ``low`` of the image (IoU-aware, as SSD's) and
            a zoom out onto a canvas up to ``high`` times larger; ``[1, 1]``: none.
        mean: normalisation's mean; default the preset's (``model_name``, linked from the model).
        std: normalisation's standard deviation, as ``mean``.
    """

    def __init__(self, root: str, layout: str = "auto", train: str = "train", val: str = "val",
                 test: str | None = "test", names: list[str] | None = None, img_size: int = 512,
                 batch_size: int = 8, num_workers: int | None = None, model_name: str | None = None,
                 hflip: float = 0.5, scale: tuple[float, float] = (1.0, 1.0), mean: tuple[float, ...] | None = None,
                 std: tuple[float, ...] | None = None, pin_memory: bool = True) -> None:
        super().__init__()
        self.save_hyperparameters()
        if layout not in LAYOUTS:
            raise UsageError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
        check_settings(img_size, hflip, scale)
        self.root = Path(root).expanduser()
        if not self.root.is_dir():
            raise MissingFileError(f"--data.root {root} is not a folder")
        first = val if self.has(val) and not self.has(train) else train  # an evaluation's folder may hold no train
        found, _, _ = find_layout(self.root, first)
        if layout not in ("auto", found):
            raise UsageError(f"{self.root} holds a {found} layout, and --data.layout is {layout}")
        self.layout = found
        read = self._read(first, None)
        self.classes, self.category_ids = read.class_names, read.category_ids  # ids: a COCO file's, else None
        self.num_classes = len(self.classes)
        self.data_cfg = data_config(model_name, img_size, mean=mean, std=std)

    sets_up_locally = True
    collate_fn = staticmethod(collate_boxes)

    def _read(self, split: str, transform) -> DetectionImages:
        layout, images, annotations = find_layout(self.root, split)
        if layout == "coco":
            return coco(images, annotations, transform)
        if layout == "voc":
            return voc(self.root, split, self.hparams.names or VOC_CLASSES, transform)
        return yolo(self.root, split, yolo_names(self.root, self.hparams.names), transform)

    def split(self, name: str, train: bool = False) -> DetectionImages:
        """Split ``name`` in the training (``train``) or the evaluation transform; its classes must be the training
        split's."""
        hp = self.hparams
        ds = self._read(name, BoxTransform(hp.img_size, train, hp.hflip, tuple(hp.scale)) if train else
                        BoxTransform(hp.img_size, False))
        if ds.class_names != self.classes or ds.category_ids != self.category_ids:
            raise UsageError(f"the {name} split of {self.describe()} names the classes {ds.class_names[:8]}, the "
                             f"training split {self.classes[:8]} (category ids {str(ds.category_ids)[:40]} and "
                             f"{str(self.category_ids)[:40]}): one list of classes for every split")
        if ds.dropped:
            rank_zero_info(f"data: {ds.dropped} box(es) of no area left out of the {name} split")
        return ds

    def has(self, name: str | None) -> bool:
        """Whether the folder holds split ``name``."""
        try:
            return name is not None and find_layout(self.root, name) is not None
        except MissingFileError:
            return False

    def setup(self, stage: str | None = None) -> None:
        if hasattr(self, "val_set"):  # once: the CLI sets up before the trainer, to refuse bad data first
            return
        hp = self.hparams
        if stage in (None, "fit") or self.has(hp.train):
            self.train_set = self.split(hp.train, True)
        self.val_set = self.split(hp.val)
        self.test_set = self.split(hp.test) if self.has(hp.test) else None

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        x, targets = batch
        return device_batch(x, self.data_cfg, 0.0), targets

    def describe(self) -> str:
        return f"DetectionDataModule({self.root}, {self.layout})"


class HFDetectionDataModule(DetectionDataModule):
    """Images with boxes from a Hugging Face dataset (transformers' detection guide's layout, cppe-5's).

    Each row holds an image column and an objects column (``bbox``, ``category``, and ``iscrowd`` where it has one).

    Args:
        name: a hub name (offline-first: the cache answers before the network) or a local folder (``save_to_disk``'s,
            or data files).
        data_files: local parquet or arrow files instead of ``name``.
        config_name: the dataset's configuration.
        revision: the dataset's revision.
        image_column: the image column.
        objects_column: the column of each image's objects.
        bbox_format: ``xywh`` (COCO's x, y, width, height in pixels, cppe-5's) or ``xyxy`` (corners in pixels).
        names: the classes in index order (default: the ``category`` feature's class names).
        train_split: the training split's name.
        val_split: the validation split's name; without one, ``val_fraction`` of the training rows are held out
            by ``seed``.
        test_split: the test split's name, where the dataset has one.

    The other arguments are :class:`DetectionDataModule`'s.
    """

    def __init__(self, name: str | None = None, data_files: Any = None, config_name: str | None = None,
                 revision: str | None = None, image_column: str = "image", objects_column: str = "objects",
                 bbox_format: str = "xywh", names: list[str] | None = None, train_split: str = "train",
                 val_split: str = "validation", test_split: str | None = "test", val_fraction: float = 0.1,
                 seed: int = 0, img_size: int = 512, batch_size: int = 8, num_workers: int | None = None,
                 model_name: str | None = None, hflip: float = 0.5, scale: tuple[float, float] = (1.0, 1.0),
                 mean: tuple[float, ...] | None = None, std: tuple[float, ...] | None = None,
                 pin_memory: bool = True) -> None:
        from vitkit.data.hf import split_rows

        super(DetectionDataModule, self).__init__()  # the loaders' base, not a folder's reading
        self.save_hyperparameters()
        check_settings(img_size, hflip, scale)
        if bbox_format not in ("xywh", "xyxy"):
            raise UsageError(f"bbox_format must be xywh (COCO's) or xyxy (corners), got {bbox_format!r}")
        self.where, self.layout = str(name if name is not None else data_files), "hf"
        self.rows = split_rows(name, data_files, config_name=config_name, revision=revision,
                               train_split=train_split, val_split=val_split, test_split=test_split,
                               val_fraction=val_fraction, seed=seed,
                               columns={image_column: "--data.image_column", objects_column: "--data.objects_column"})
        train = self.rows["train"]
        self.classes = list(names or self._category_names(train))
        self.category_ids = None  # the category feature's values are the class indices
        self.num_classes = len(self.classes)
        self.data_cfg = data_config(model_name, img_size, mean=mean, std=std)

    def _category_names(self, train) -> list[str]:
        """The class names of the objects column's ``category`` feature (a ClassLabel, in a list)."""
        feature = train.features[self.hparams.objects_column]
        inner = getattr(feature, "feature", feature)  # Sequence({...}) or the mapping of lists it becomes
        category = inner.get("category") if isinstance(inner, dict) else None
        names = getattr(getattr(category, "feature", category), "names", None)
        if not names:
            raise UsageError(f"{self.where}: the {self.hparams.objects_column} column's category feature names no "
                             "classes (a ClassLabel); give --data.names")
        return list(names)

    def _read(self, split: str, transform) -> HFDetectionImages:
        from vitkit.data.hf import undecoded

        hp = self.hparams
        return HFDetectionImages(undecoded(self.rows[split], hp.image_column), hp.image_column, hp.objects_column,
                                 self.classes, hp.bbox_format, transform)

    def has(self, name: str | None) -> bool:
        return name in getattr(self, "rows", {})

    def setup(self, stage: str | None = None) -> None:
        if hasattr(self, "val_set"):
            return
        if stage in (None, "fit") or self.has("train"):
            self.train_set = self.split("train", True)
        self.val_set = self.split("val")
        self.test_set = self.split("test") if self.has("test") else None

    def describe(self) -> str:
        return f"HFDetectionDataModule({self.where})"
