"""What ``vitkit evaluate`` does the same for every task, below the tasks that evaluate
(``vitkit.tasks.<task>.evaluate``): the data module built with the model's own preprocessing where the command line
leaves it, the split scored, and a model run under bf16 autocast as a run validated it."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import lightning as L
import torch

from vitkit.errors import UsageError

PREPROCESSING = ("img_size", "mean", "std", "crop_pct", "interpolation", "crop_mode", "packing", "max_patches")
PRECISIONS = ("32-true", "bf16-mixed")


class Autocast:
    """``model`` under bf16 autocast, as Lightning's bf16-mixed runs validation: a call of it, of its ``features``
    and of its ``forward_packed`` runs under autocast; any other attribute (its config, patch size) is the model's."""

    def __init__(self, model, device: torch.device) -> None:
        self._model, self._device = model, device

    def _autocast(self, fn):
        def wrapped(*args, **kwargs):
            with torch.autocast(self._device.type, dtype=torch.bfloat16):
                return fn(*args, **kwargs)
        return wrapped

    def __call__(self, *args, **kwargs):
        return self._autocast(self._model)(*args, **kwargs)

    def __getattr__(self, name: str):
        value = getattr(self._model, name)
        return self._autocast(value) if name in ("features", "forward_packed") else value


def build_data(cfg, prep: dict, explicit: set[str], eval_train: bool, model=None) -> L.LightningDataModule:
    """The data module, its preprocessing the model's where the command line (``explicit``) leaves it; for a
    backbone, its train split in the eval transform (features of the images as they are)."""
    from importlib import import_module

    module, _, name = cfg.data.class_path.rpartition(".")
    klass = getattr(import_module(module), name)
    accepted = set()
    for c in klass.__mro__:
        if "__init__" in vars(c):
            accepted |= set(inspect.signature(c.__init__).parameters)
    args = dict(vars(cfg.data.init_args))
    for k in PREPROCESSING:
        if k in accepted and k not in explicit and k in prep:
            args[k] = prep[k]
    if "train_dir" in accepted and not eval_train and "train_dir" not in explicit:
        args.update(scored_folder(args))
    dm = klass(**args)
    if args.get("packing"):  # images of their own sizes, packed for this model (which no trainer holds here)
        if model is None or not hasattr(model, "forward_packed"):
            raise UsageError("--data.packing packs images for a ViT's forward_packed: evaluate a --checkpoint or "
                             "--model of a ViT (an ONNX file takes one image size)")
        dm.packed_model = model
    if eval_train and hasattr(dm, "eval_transform"):
        dm.train_transform = dm.eval_transform
    dm.setup("test")
    return dm


def scored_folder(args: dict) -> dict:
    """A classifier's score reads no train split: an image folder without ``train/`` is scored from its ``val/`` (or
    ``test/``) alone, or, with neither, as the class folders themselves (``root/<class>/<images>``). A backbone's
    k-NN and probe fit on ``train/`` and keep the folder's own layout."""
    root = Path(args["root"]).expanduser()
    train, val, test = args.get("train_dir", "train"), args.get("val_dir", "val"), args.get("test_dir", "test")
    if not root.is_dir() or (root / train).is_dir():
        return {}
    if (root / val).is_dir():
        return {"train_dir": val}
    if test and (root / test).is_dir():
        return {"train_dir": test, "val_dir": test}
    return {"train_dir": ".", "val_dir": ".", "test_dir": None}


def window_stride(stride: int | list[int] | None) -> tuple[int, int] | None:
    """``--stride N`` or ``[H, W]`` as (H, W)."""
    if stride is None:
        return None
    stride = [stride] if isinstance(stride, int) else stride
    if len(stride) not in (1, 2):
        raise UsageError(f"--stride takes one number or [H, W], got {stride}")
    return (stride[0], stride[-1])


def pick_split(dm, split: str | None) -> tuple[str, Any]:
    test = getattr(dm, "test_set", None)
    if split is None:
        return ("test", test) if test is not None else ("val", dm.val_set)
    if split == "test" and test is None:
        raise UsageError(f"{dm.describe()} has no test split; give --split val")
    if split not in ("test", "val", "train"):
        raise UsageError(f"--split {split!r}: expected test, val or train")
    return split, {"test": test, "val": dm.val_set, "train": getattr(dm, "train_set", None)}[split]
