"""Images of their own sizes for training and evaluation (``--data.packing true``): each image resized within a
patch budget at its aspect ratio by timm's NaFlex transforms (whole, at a random share of the budget, in training),
then each batch packed into sequences of ``max_tokens`` slots (``vitkit.models.packing.pack``), which the ViT runs
with attention kept inside each image."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from timm.data import create_transform
from timm.data.naflex_transforms import RandomResizedCropToSequence
from torch import nn

from vitkit.data.folder import stack_targets
from vitkit.data.transforms import keep_one_bit
from vitkit.errors import UsageError
from vitkit.models.config import pair
from vitkit.models.packing import PackedBatch, pack


@dataclass(frozen=True)
class Packing:
    """How a data module packs: the model's patch size and prefix tokens, each image's patch budget
    (``max_patches``) and the slots of a sequence (``max_tokens``)."""

    patch_size: int
    max_patches: int
    max_tokens: int
    prefix: int
    drop: float = 0.0  # the share of each image's patches left out, in training (NaViT's token dropping)

    def __post_init__(self) -> None:
        if not 0.0 <= self.drop < 1.0:
            raise UsageError(f"--data.token_drop is the share of each image's patches left out in training, in "
                             f"[0, 1); got {self.drop}")
        if self.max_tokens < self.max_patches + self.prefix:
            raise UsageError(f"--data.max_tokens {self.max_tokens} is smaller than one image's budget of "
                             f"{self.max_patches} patches and {self.prefix} prefix token(s); give at least "
                             f"{self.max_patches + self.prefix}, or a smaller --data.max_patches")

    def train_transform(self, cfg, *, auto_augment: str | None, re_prob: float, scale: tuple[float, float],
                        hflip: float, color_jitter: float | None) -> nn.Module:
        """timm's NaFlex train pipeline, each image kept whole at its own aspect ratio: resized to a random share of
        the patch budget (``scale``, a share of its area, as a random crop's), then flip, RandAugment (or colour
        jitter), normalise, random erasing. No random crop: on images of their own shapes a crop cuts away what a
        label may name (a strip labelled by its left end), as squashing a whole image does not
        (docs/data.md)."""
        tf = keep_one_bit(create_transform(
            input_size=(cfg.in_chans, *pair(cfg.img_size)), is_training=True, scale=tuple(scale), hflip=hflip,
            color_jitter=color_jitter, auto_augment=auto_augment, interpolation="bicubic", re_prob=re_prob,
            re_mode="pixel", re_count=1, mean=cfg.mean, std=cfg.std, naflex=True, patch_size=self.patch_size,
            max_seq_len=self.max_patches))
        low, high = (min(1.0, max(0.0, s)) ** 0.5 for s in scale)  # sides scale by the root of the area's share
        tf.transforms[0] = RandomResizedCropToSequence(self.patch_size, self.max_patches, scale=(1.0, 1.0),
                                                       ratio=(1.0, 1.0), interpolation="bicubic",
                                                       final_scale_range=(low, high))
        return tf

    def eval_transform(self, cfg) -> nn.Module:
        """The whole image resized within the budget at its aspect ratio (timm's NaFlex eval), normalised."""
        return create_transform(input_size=(cfg.in_chans, *pair(cfg.img_size)), is_training=False,
                                interpolation=cfg.interpolation, mean=cfg.mean, std=cfg.std, naflex=True,
                                patch_size=self.patch_size, max_seq_len=self.max_patches)

    def collate(self, items: list) -> tuple[PackedBatch | None, torch.Tensor | None, int]:
        """The readable samples packed, their targets, and how many were skipped (None, None when all were)."""
        return self._collate(items, 0.0)

    def train_collate(self, items: list) -> tuple[PackedBatch | None, torch.Tensor | None, int]:
        """:meth:`collate`, each image's patches thinned by ``drop``."""
        return self._collate(items, self.drop)

    def _collate(self, items: list, drop: float) -> tuple[PackedBatch | None, torch.Tensor | None, int]:
        good = [it for it in items if it is not None]
        if not good:
            return None, None, len(items)
        packed = pack([x for x, _ in good], self.patch_size, self.max_tokens, self.prefix, drop)
        return packed, stack_targets([y for _, y in good]), len(items) - len(good)


def packing_for(model, model_name: str | None, img_size, max_patches: int | None, max_tokens: int | None,
                drop: float = 0.0) -> Packing:
    """The packing of a data module for ``model`` (the run's ViT; None before one is attached, and then the preset
    ``model_name`` says its patch size and prefix tokens). The budget by default: the patches of ``img_size``; a
    sequence by default: one budget and its prefix."""
    patch, prefix = _geometry(model, model_name)
    if drop and hasattr(model, "token_drop_refusal"):  # a model that hides patches of its own (MAE, DINO)
        raise UsageError(model.token_drop_refusal(drop))
    h, w = pair(img_size)
    budget = max_patches if max_patches is not None else (h // patch) * (w // patch)
    return Packing(patch, budget, max_tokens if max_tokens is not None else budget + prefix, prefix, drop)


def _geometry(model, model_name: str | None) -> tuple[int, int]:
    """(patch size, prefix tokens) of ``model``, or of the preset ``model_name``'s config."""
    swin = "--data.packing: Swin cannot pack images of their own sizes (its windows need one fixed grid); pack a ViT"
    if model is not None:
        if not hasattr(model, "forward_packed"):
            reason = getattr(model, "cannot_pack", None)
            raise UsageError(f"--data.packing: {reason}" if reason else swin.replace("Swin", type(model).__name__))
        return model.patch_size, model.num_prefix_tokens
    if model_name is None:
        raise UsageError("--data.packing needs the model's patch size: give --data.model_name (the CLI links it from "
                         "the model)")
    from vitkit.models.registry import preset_config

    cfg = preset_config(model_name)
    if not hasattr(cfg, "class_token"):
        raise UsageError(swin)
    return cfg.patch_size, int(cfg.class_token) + int(cfg.distilled) + cfg.reg_tokens
