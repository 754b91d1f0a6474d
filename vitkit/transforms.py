"""Image transforms, from timm's factory so that they match the recipes the presets were trained with."""

from __future__ import annotations

from timm.data import create_transform
from timm.data.auto_augment import AugmentOp
from torch import nn

from .models.config import pair

# The train-augmentation arguments of the image data modules, passed to ``train_transform`` as they are.
TRAIN_AUGMENT = ("auto_augment", "re_prob", "scale", "hflip", "color_jitter")


def eval_transform(cfg) -> nn.Module:
    """Resize to img_size / crop_pct, center-crop img_size, to tensor, normalise with the model's mean/std."""
    return create_transform(input_size=(cfg.in_chans, *pair(cfg.img_size)), is_training=False,
                            interpolation=cfg.interpolation, mean=cfg.mean, std=cfg.std, crop_pct=cfg.crop_pct)


def train_transform(cfg, *, auto_augment: str | None = "rand-m9-mstd0.5-inc1", re_prob: float = 0.25,
                    scale: tuple[float, float] = (0.08, 1.0), hflip: float = 0.5,
                    color_jitter: float | None = 0.4) -> nn.Module:
    """timm's train pipeline: RandomResizedCrop, flip, RandAugment (or, without it, colour jitter), normalise,
    random erasing."""
    tf = create_transform(input_size=(cfg.in_chans, *pair(cfg.img_size)), is_training=True, scale=tuple(scale),
                          hflip=hflip, color_jitter=color_jitter, auto_augment=auto_augment, interpolation="bicubic",
                          re_prob=re_prob, re_mode="pixel", re_count=1, mean=cfg.mean, std=cfg.std)
    for t in getattr(tf, "transforms", []):
        for op in getattr(t, "ops", []):
            if isinstance(op, AugmentOp) and op.name.startswith("Posterize"):
                op.level_fn = _at_least_one_bit(op.level_fn)
    return tf


class _at_least_one_bit:  # noqa: N801 - used like the function it wraps
    """timm's posterize keeps 0 bits at magnitude 10 (reachable with mstd noise), which Pillow >= 11
    rejects mid-epoch; 1 bit is the strongest posterize Pillow accepts. A class, not a closure, so the
    transform pickles into loader workers started with ``spawn`` (macOS, or after litdata's ``optimize``)."""

    def __init__(self, level_fn) -> None:
        self.level_fn = level_fn

    def __call__(self, level, hparams) -> tuple[int]:
        return (max(1, self.level_fn(level, hparams)[0]),)
