"""Image data modules: ImageNet-style folders, unlabeled folders and manifests (over ``SkippingImages``, which skips
unreadable files and packs batches with ``--data.packing``), and the handwritten digits that ship with scikit-learn;
their loaders are ``loaders.py``'s."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import TensorDataset

from vitkit.data.folder import (
    Decoder,
    SkippingImageFolder,
    UnlabeledImages,
    collate_skipping,
    scan_image_folder,
    scan_unlabeled,
)
from vitkit.data.manifest import ManifestImages, check_rows, read_manifest, targets
from vitkit.data.packing import Packing, packing_for
from vitkit.data.transforms import (
    TRAIN_AUGMENT,
    data_config,
    default_augment,
    device_batch,
    eval_transform,
    random_affine,
    train_transform,
)
from vitkit.errors import UsageError
from vitkit.models.config import CropMode, pair

from .loaders import _TrainValLoaders

log = logging.getLogger(__name__)

class DigitsDataModule(_TrainValLoaders):
    """The 1,797 real 8x8 handwritten digits bundled with scikit-learn, upsampled; no download.

    A fixed, seeded, stratified train/val split (and a test split when ``test_fraction`` > 0, held out
    before the others); training batches get a random affine jitter. ``train_per_class`` keeps that many training
    digits of each class (a few labels, as after pre-training on unlabeled images); validation keeps its split."""

    classes: list[str] = [str(i) for i in range(10)]
    num_classes: int = 10
    sets_up_locally = True
    # the settings that decide which digits train: a test split is held out only from a run trained with the same
    SPLIT_SETTINGS = ("val_fraction", "test_fraction", "seed", "train_per_class")

    def __init__(self, img_size: int | tuple[int, int] = 32, batch_size: int = 64, num_workers: int = 0,
                 val_fraction: float = 0.2,
                 seed: int = 0, augment: bool = True, model_name: str | None = None, test_fraction: float = 0.0,
                 mean: tuple[float, ...] | None = None, std: tuple[float, ...] | None = None,
                 train_per_class: int | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        if train_per_class is not None and train_per_class < 1:
            raise UsageError(f"train_per_class must be >= 1 (or null: every training digit), got {train_per_class}")
        self.data_cfg = data_config(model_name, img_size, mean=mean, std=std)

    def _tensors(self) -> tuple[Tensor, Tensor]:
        from sklearn.datasets import load_digits

        digits = load_digits()
        x = torch.tensor(digits.images, dtype=torch.float32)[:, None] / 16.0  # (N, 1, 8, 8) in [0, 1]
        x = F.interpolate(x, size=pair(self.data_cfg.img_size), mode="bilinear", align_corners=False)
        x = x.expand(-1, 3, -1, -1)  # grey -> RGB, like ImageFolder's convert("RGB")
        mean = torch.tensor(self.data_cfg.mean).view(1, 3, 1, 1)
        std = torch.tensor(self.data_cfg.std).view(1, 3, 1, 1)
        return ((x - mean) / std).contiguous(), torch.tensor(digits.target, dtype=torch.long)

    def setup(self, stage: str | None = None) -> None:
        if hasattr(self, "train_set"):
            return
        from sklearn.model_selection import train_test_split

        hp = self.hparams
        x, y = self._tensors()
        idx = torch.arange(len(y)).numpy()
        if hp.test_fraction > 0:  # held out first, so the train/val split of the rest stays stratified
            idx, idx_test = train_test_split(idx, test_size=hp.test_fraction, random_state=hp.seed,
                                             stratify=y.numpy())
            self.test_set = TensorDataset(x[idx_test], y[idx_test])
        idx_train, idx_val = train_test_split(idx, test_size=hp.val_fraction, random_state=hp.seed,
                                              stratify=y[idx].numpy())
        if hp.train_per_class is not None:  # few labels: the first of each class in the split's seeded order
            idx_train = [i for c in range(10) for i in idx_train[y[idx_train].numpy() == c][: hp.train_per_class]]
        self.train_set = TensorDataset(x[idx_train], y[idx_train])
        self.val_set = TensorDataset(x[idx_val], y[idx_val])

    def on_after_batch_transfer(self, batch: tuple[Tensor, Tensor], dataloader_idx: int) -> tuple[Tensor, Tensor]:
        if self.hparams.augment and self.trainer is not None and self.trainer.training:
            x, y = batch
            return random_affine(x, degrees=10, translate=0.1, scale=(0.9, 1.1)), y
        return batch



class SkippingImages(_TrainValLoaders):
    """The base of every image data source (a folder, a manifest, Hugging Face, shards; a new source subclasses it).

    Unreadable files are skipped and counted, batch by batch and epoch by epoch.

    Its arguments are those of every image DataModule (each subclass passes its ``**image_args`` on, and the CLI
    lists them with the subclass's own): loader sizes, timm's train augmentation, and the eval preprocessing,
    whose mean, std, crop_pct and interpolation default to the preset's (``model_name``, linked from the model
    by the CLI)."""

    may_yield_empty = True

    def __init__(self, img_size: int | tuple[int, int] = 224, batch_size: int = 128, num_workers: int | None = None,
                 model_name: str | None = None, auto_augment: str | None = "auto",
                 re_prob: float | None = None, scale: tuple[float, float] | None = None, hflip: float | None = None,
                 color_jitter: float | str | None = "auto", crop_pct: float | None = None,
                 mean: tuple[float, ...] | None = None, std: tuple[float, ...] | None = None,
                 interpolation: str | None = None, crop_mode: CropMode | None = None,
                 pin_memory: bool = True, packing: bool = False, max_patches: int | None = None,
                 max_tokens: int | None = None, token_drop: float = 0.0) -> None:
        """``packing``: images keep their aspect ratio, each resized within ``max_patches`` patches (by default
        img_size's), and a batch is packed into sequences of ``max_tokens`` slots (by default one budget and the
        model's prefix tokens) for a ViT's ``forward_packed``, in training with ``token_drop`` of each image's
        patches left out; ``vitkit.data.packing``."""
        super().__init__()
        self.save_hyperparameters()  # with the subclass's own arguments (Lightning collects the whole chain)
        self.data_cfg = data_config(model_name, img_size, crop_pct=crop_pct, mean=mean, std=std,
                                    interpolation=interpolation, crop_mode=crop_mode)
        self.augmentation()  # a value that is none of the field's refused now, not at the first epoch
        if not packing and (max_patches is not None or max_tokens is not None or token_drop):
            raise UsageError("--data.max_patches, --data.max_tokens and --data.token_drop are for packed batches: add "
                             "--data.packing true")
        for name, value in (("max_patches", max_patches), ("max_tokens", max_tokens)):
            if value is not None and value < 1:
                raise UsageError(f"--data.{name} must be >= 1, got {value}")

    packed_model = None  # the model packed batches are for, where no trainer holds it (``vitkit evaluate``)

    def pack_plan(self) -> Packing | None:
        """How batches are packed (None without ``packing``): for the run's model (the trainer's, else
        ``packed_model``), else for the preset ``model_name``."""
        hp = self.hparams
        if not hp.get("packing"):
            return None
        module = self.trainer.lightning_module if self.trainer is not None else None
        model = getattr(module, "model", None) or self.packed_model
        return packing_for(model, hp.model_name, self.data_cfg.img_size, hp.max_patches, hp.max_tokens,
                           hp.get("token_drop", 0.0))

    def collate_for(self, train: bool):
        plan = self.pack_plan()
        return collate_skipping if plan is None else plan.train_collate if train else plan.collate

    def eval_transform(self):
        """The eval preprocessing: ``transforms.eval_transform``, or with packing each whole image resized within its
        patch budget at its aspect ratio."""
        plan = self.pack_plan()
        return eval_transform(self.data_cfg) if plan is None else plan.eval_transform(self.data_cfg)

    def augmentation(self) -> dict:
        """The train augmentation: the fields given, the rest by image size (``transforms.default_augment``)."""
        return default_augment(self.data_cfg.img_size, **{k: self.hparams[k] for k in TRAIN_AUGMENT})

    def train_transform(self):
        """Decoding and augmentation in the loader's workers, up to uint8 tensors; normalisation and random erasing
        happen on the device (:meth:`on_after_batch_transfer`), as in timm's training script."""
        plan = self.pack_plan()
        if plan is not None:  # images of their own sizes: augmented and normalised in the workers
            return plan.train_transform(self.data_cfg, **self.augmentation())
        if self.hparams.get("scale") is not None and getattr(self.data_cfg, "crop_mode", "center") == "squash":
            log.warning("--data.scale %s sizes a random crop, and crop_mode squash takes each image whole (no "
                        "crop): it does not apply; --data.crop_mode center crops", list(self.hparams["scale"]))
        return train_transform(self.data_cfg, **self.augmentation(), on_device=True)

    def reset_counts(self) -> None:
        self.skipped = {"train": 0, "val": 0, "test": 0}
        self.seen = {"train": 0, "val": 0, "test": 0}

    def split_location(self, split: str) -> str:
        raise NotImplementedError

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        """Count the files a batch had to skip. A batch with none left becomes an empty batch, never None:
        Lightning would drop a None batch on that rank alone, and under DDP the other ranks would then wait
        for it in the next collective; the module skips an empty batch on every rank together. A uint8 batch (the
        training split's) is normalised and erased here, on the device."""
        x, y, skipped = batch
        trainer = self.trainer
        split = "train" if trainer and trainer.training else "test" if trainer and trainer.testing else "val"
        self.skipped[split] += int(skipped)
        self.seen[split] += 0 if x is None else len(x)
        if x is None:
            x = torch.empty(0, self.data_cfg.in_chans, *pair(self.data_cfg.img_size))
            y = torch.empty(0, self.num_classes) if getattr(self, "multi_label", False) else \
                torch.empty(0, dtype=torch.long)
        elif isinstance(x, Tensor) and x.dtype == torch.uint8:
            x = device_batch(x, self.data_cfg, self.augmentation()["re_prob"] if split == "train" else 0.0)
        return x, y

    def report_skipped(self, split: str) -> int:
        """Log (once per epoch) how many unreadable files were skipped; raise if nothing was readable."""
        skipped, seen = self.skipped[split], self.seen[split]
        self.skipped[split] = self.seen[split] = 0
        if skipped and not seen:
            raise RuntimeError(f"no usable images in {self.split_location(split)}: "
                               f"all {skipped} files read this epoch were unreadable (corrupt or not images)")
        if skipped:
            log.warning("%s: skipped %d unreadable image file(s) this epoch (%d used); add --verbose to the command "
                        "(or set the logger 'vitkit' to DEBUG) for their paths", split, skipped, seen)
        return skipped


class ImageFolderDataModule(SkippingImages):
    """ImageNet layout (``root/train/<class>/*``, ``root/val/<class>/*``, optionally ``root/test/<class>/*``)
    with timm's transforms. ``test`` evaluates ``test_dir`` when it exists, else the val split (and says so).

    Train: RandomResizedCrop (bicubic), flip, RandAugment (colour jitter instead when ``auto_augment`` is None;
    ``color_jitter=None`` turns that off too), random erasing. Eval: resize to
    ``img_size / crop_pct`` and center-crop. Mean, std, crop_pct and interpolation default to the
    preset's (``model_name``, linked from the model by the CLI)."""

    sets_up_locally = True

    def __init__(self, root: str, train_dir: str = "train", val_dir: str = "val", test_dir: str | None = "test",
                 decoder: Decoder = "pil", **image_args) -> None:
        super().__init__(**image_args)
        self.root = Path(os.path.expanduser(root))
        self.classes = scan_image_folder(self.root, train_dir, val_dir, test_dir)
        self.num_classes = len(self.classes)

    def setup(self, stage: str | None = None) -> None:
        self.reset_counts()
        if hasattr(self, "train_set"):
            return
        hp = self.hparams
        self.train_set = SkippingImageFolder(str(self.root / hp.train_dir), self.train_transform(), hp.decoder)
        self.val_set = SkippingImageFolder(str(self.root / hp.val_dir), self.eval_transform(), hp.decoder)
        if hp.test_dir and (self.root / hp.test_dir).is_dir():
            self.test_set = SkippingImageFolder(str(self.root / hp.test_dir), self.eval_transform(), hp.decoder)

    def describe(self) -> str:
        return str(self.root)

    def split_location(self, split: str) -> str:
        return str(self.root / getattr(self.hparams, split + "_dir"))


class UnlabeledImageDataModule(SkippingImages):
    """A folder of images without labels, for self-supervised pre-training.

    ``root/**/*.jpg``, any layout, class folders or none. A fixed, seeded ``val_fraction`` of the files is held out for
    validation, the same on every rank and run. Transforms and unreadable-file skipping as ``ImageFolderDataModule``'s
    (MAE's recipe turns the augmentation down to RandomResizedCrop and flips)."""

    classes: list[str] = []
    num_classes: int = 0
    sets_up_locally = True

    def __init__(self, root: str, val_fraction: float = 0.05, seed: int = 0, decoder: Decoder = "pil",
                 **image_args) -> None:
        super().__init__(**image_args)
        if not 0 <= val_fraction < 1:
            raise UsageError(f"val_fraction must be in [0, 1), got {val_fraction}")
        self.root = Path(os.path.expanduser(root))
        self.files = scan_unlabeled(self.root)

    def setup(self, stage: str | None = None) -> None:
        self.reset_counts()
        if hasattr(self, "train_set"):
            return
        hp = self.hparams
        order = torch.randperm(len(self.files), generator=torch.Generator().manual_seed(hp.seed)).tolist()
        n_val = max(1, round(len(self.files) * hp.val_fraction)) if hp.val_fraction > 0 and len(self.files) > 1 \
            else 0
        val, train = [self.files[i] for i in sorted(order[:n_val])], [self.files[i] for i in sorted(order[n_val:])]
        self.train_set = UnlabeledImages(train, self.train_transform(), hp.decoder)
        self.val_set = UnlabeledImages(val, self.eval_transform(), hp.decoder)

    def describe(self) -> str:
        return str(self.root)

    def split_location(self, split: str) -> str:
        return f"{self.root} ({split})"


class ManifestDataModule(SkippingImages):
    """Images and their labels (one or several) listed in CSV or JSON-lines manifests.

    A manifest (``vitkit/data/manifest.py``) is a CSV with a header, or JSON lines, with an ``image`` column (a path
    relative to the manifest) and a ``labels`` column (one or several class names, separated by ``label_separator``; a
    JSON-lines row may give a list). Transforms and unreadable-file skipping as :class:`ImageFolderDataModule`'s.

    ``classes``: the class list, in order; by default the sorted names the training manifest uses. ``multi_label``:
    several labels per image (multi-hot targets, for ``--model.labels MultiLabel``, which the CLI links); by default
    true where a training row has more than one label. A single-label manifest gives class indices, as a folder
    does. Several labels per image train and evaluate the whole image (``crop_mode`` squash) unless ``crop_mode``
    is given. A label outside the classes, an empty path, a missing file, or a single-label row without one label
    ends in one line naming the row and the file."""

    sets_up_locally = True

    def __init__(self, train_manifest: str, val_manifest: str, test_manifest: str | None = None,
                 image_column: str = "image", label_column: str = "labels", label_separator: str = " ",
                 classes: list[str] | None = None, multi_label: bool | None = None, decoder: Decoder = "pil",
                 **image_args) -> None:
        super().__init__(**image_args)
        if not label_separator:
            raise UsageError("label_separator must not be empty (a space by default)")
        read = dict(image_column=image_column, label_column=label_column, separator=label_separator)
        self.manifests = {"train": read_manifest(train_manifest, **read), "val": read_manifest(val_manifest, **read)}
        if test_manifest:
            self.manifests["test"] = read_manifest(test_manifest, **read)
        train = self.manifests["train"]
        for hp in (self.hparams, self._hparams_initial):  # the module's multi_label is the run's (Lightning merges
            hp.pop("multi_label")                         # the two into one record); the data's says what it holds
        self.multi_label = bool(multi_label) if multi_label is not None else \
            any(len(row) > 1 for row in train.labels)
        if self.multi_label and image_args.get("crop_mode") is None:  # labels anywhere in the image: keep it whole
            self.data_cfg.crop_mode = "squash"
        self.classes = list(classes) if classes else train.names()
        if not self.classes:
            raise UsageError(f"{train.path}: no row has a label, and no --data.classes were given")
        if len(set(self.classes)) != len(self.classes):
            raise UsageError(f"--data.classes names a class twice: {self.classes}")
        for manifest in self.manifests.values():
            check_rows(manifest, self.classes, self.multi_label)
        self.num_classes = len(self.classes)

    def setup(self, stage: str | None = None) -> None:
        self.reset_counts()
        if hasattr(self, "train_set"):
            return
        sets = {}
        for split, manifest in self.manifests.items():
            transform = self.train_transform() if split == "train" else self.eval_transform()
            sets[split] = ManifestImages(manifest.images, targets(manifest, self.classes, self.multi_label),
                                         transform, self.hparams.decoder)
        self.train_set, self.val_set, self.test_set = sets["train"], sets["val"], sets.get("test")

    def label_counts(self) -> tuple[torch.Tensor, int]:
        """How many training images carry each class (C,), and how many there are (for BCE's ``pos_weight``)."""
        t = targets(self.manifests["train"], self.classes, self.multi_label)
        counts = t.sum(0) if self.multi_label else torch.bincount(t, minlength=self.num_classes).float()
        return counts, len(t)

    def describe(self) -> str:
        return ", ".join(str(m.path) for m in self.manifests.values())

    def split_location(self, split: str) -> str:
        return str(self.manifests[split].path)
