"""Image transforms, from timm's factory so that they match the recipes the presets were trained with."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from PIL import ImageOps
from timm.data import create_transform
from timm.data.auto_augment import AugmentOp
from torch import Tensor, nn

from vitkit.errors import UsageError

from ..checkpoints.names import get_config
from ..models.config import CROP_MODES, IMAGENET, pair

# The train-augmentation arguments of the image data modules, passed to ``train_transform`` as they are.
TRAIN_AUGMENT = ("auto_augment", "re_prob", "scale", "hflip", "color_jitter")

SMALL_IMAGE = 64  # px: below it (digits, icons, CIFAR-sized images) the default augmentation is a mild crop alone
IMAGENET_AUGMENT = {"auto_augment": "rand-m9-mstd0.5-inc1", "re_prob": 0.25, "scale": (0.08, 1.0), "hflip": 0.5,
                    "color_jitter": 0.4}
SMALL_AUGMENT = {"auto_augment": None, "re_prob": 0.0, "scale": (0.8, 1.0), "hflip": 0.0, "color_jitter": None}


def default_augment(img_size: int | tuple[int, int], **given) -> dict:
    """The train augmentation for images of ``img_size``, where ``given`` leaves a field to the size ("auto", or
    None for scale, hflip and re_prob): timm's ImageNet pipeline from ``SMALL_IMAGE`` px up; below it a crop of 80 %
    of the image or more and nothing else (an 8 % crop, a flip or RandAugment destroys a 28 px digit)."""
    jitter = given.get("color_jitter", "auto")
    if isinstance(jitter, str) and jitter != "auto":
        raise UsageError(f"color_jitter expects a number, 'auto' (by image size) or null (off), got {jitter!r}")
    base = SMALL_AUGMENT if min(pair(img_size)) < SMALL_IMAGE else IMAGENET_AUGMENT
    auto = {"auto_augment": "auto", "color_jitter": "auto"}  # None is a value of these two: off
    return {k: base[k] if given.get(k, auto.get(k)) == auto.get(k) else given[k] for k in TRAIN_AUGMENT}


def eval_transform(cfg) -> nn.Module:
    """Resize to img_size / crop_pct, center-crop img_size, to tensor, normalise with the model's mean/std; with
    ``cfg.crop_mode`` "squash", the whole image resized to img_size (H, W), nothing cropped."""
    squash = getattr(cfg, "crop_mode", "center") == "squash"
    return create_transform(input_size=(cfg.in_chans, *pair(cfg.img_size)), is_training=False,
                            interpolation=cfg.interpolation, mean=cfg.mean, std=cfg.std,
                            crop_pct=1.0 if squash else cfg.crop_pct, crop_mode="squash" if squash else "center")


def train_transform(cfg, *, auto_augment: str | None = "rand-m9-mstd0.5-inc1", re_prob: float = 0.25,
                    scale: tuple[float, float] = (0.08, 1.0), hflip: float = 0.5,
                    color_jitter: float | None = 0.4, on_device: bool = False) -> nn.Module:
    """timm's train pipeline: RandomResizedCrop, flip, RandAugment (or, without it, colour jitter), normalise,
    random erasing. With ``on_device`` it stops at uint8 (C, H, W) tensors, as timm's prefetcher takes them: a
    quarter of float32's bytes across the loader's worker boundary and to the device, where :func:`device_batch`
    normalises and erases."""
    if getattr(cfg, "crop_mode", "center") == "squash":
        return _squash_train(cfg, hflip, color_jitter, auto_augment, re_prob, on_device)
    tf = create_transform(input_size=(cfg.in_chans, *pair(cfg.img_size)), is_training=True, scale=tuple(scale),
                          hflip=hflip, color_jitter=color_jitter, auto_augment=auto_augment, interpolation="bicubic",
                          re_prob=0.0 if on_device else re_prob, re_mode="pixel", re_count=1, mean=cfg.mean,
                          std=cfg.std, use_prefetcher=on_device)
    return keep_one_bit(tf)


def keep_one_bit(tf):
    """timm's pipeline ``tf`` with each RandAugment Posterize kept at one bit or more (:class:`AtLeastOneBit`)."""
    for t in getattr(tf, "transforms", []):
        ops = getattr(t, "ops", None)
        if isinstance(ops, list):
            ops[:] = [AtLeastOneBit(op) if isinstance(op, AugmentOp) and op.name.startswith("Posterize") else op
                      for op in ops]
    return tf


def _squash_train(cfg, hflip: float, color_jitter: float | None, auto_augment: str | None, re_prob: float,
                  on_device: bool) -> nn.Module:
    """The whole image resized to img_size (as :func:`eval_transform` squashes it), then flip, RandAugment or
    colour jitter, as timm's pipeline would: no random crop, which could cut a labelled object out."""
    from timm.data.transforms import MaybePILToTensor, MaybeToTensor, str_to_interp_mode
    from torchvision import transforms as T

    tfl = [T.Resize(pair(cfg.img_size), interpolation=str_to_interp_mode(cfg.interpolation))]
    if hflip > 0:
        tfl.append(T.RandomHorizontalFlip(hflip))
    if auto_augment:
        from timm.data.auto_augment import rand_augment_transform

        tfl.append(rand_augment_transform(auto_augment, {"translate_const": int(min(pair(cfg.img_size)) * 0.45),
                                                         "img_mean": tuple(round(255 * m) for m in cfg.mean)}))
    elif color_jitter:
        tfl.append(T.ColorJitter(*(float(color_jitter),) * 3))
    if on_device:
        return keep_one_bit(T.Compose([*tfl, MaybePILToTensor()]))
    tfl += [MaybeToTensor(), T.Normalize(cfg.mean, cfg.std)]
    if re_prob > 0:
        from timm.data.random_erasing import RandomErasing

        tfl.append(RandomErasing(probability=re_prob, mode="pixel", max_count=1, device="cpu"))
    return keep_one_bit(T.Compose(tfl))


def device_batch(x: Tensor, cfg, re_prob: float = 0.0) -> Tensor:
    """A uint8 batch (B, C, H, W) from :func:`train_transform` with ``on_device``, on the device it trains on: as
    float32, normalised with ``cfg``'s mean and std (the same values as ToTensor and Normalize give, within float
    rounding), then timm's random erasing with probability ``re_prob`` per image (per-pixel normal noise, one box)."""
    mean = torch.tensor(cfg.mean, device=x.device).view(1, -1, 1, 1) * 255
    std = torch.tensor(cfg.std, device=x.device).view(1, -1, 1, 1) * 255
    x = (x.float() - mean) / std
    if re_prob > 0:
        from timm.data.random_erasing import RandomErasing

        x = RandomErasing(probability=re_prob, mode="pixel", max_count=1, device=x.device)(x)
    return x


class AtLeastOneBit:
    """timm's posterize keeps 0 bits at magnitude 10 (reachable with mstd noise), which Pillow >= 11 rejects
    mid-epoch; this wraps timm's op and gives 1 bit, the strongest posterize Pillow accepts, where it would
    have given 0. A class, not a closure, so the transform pickles into loader workers started with ``spawn``
    (macOS, or after litdata's ``optimize``)."""

    def __init__(self, op: AugmentOp) -> None:
        self.op = op

    def __call__(self, img):
        try:
            return self.op(img)
        except ValueError as e:  # Pillow: "bits must be in range 1 to 8" (0 asked)
            if "bits" not in str(e):
                raise
            return ImageOps.posterize(img, 1)

    def __repr__(self) -> str:
        return repr(self.op)


def data_config(model_name: str | None, img_size: int | tuple[int, int], **given) -> SimpleNamespace:
    """The eval-data settings of a preset (mean, std, crop_pct, interpolation, crop_mode), any of them overridden;
    ``img_size`` one int or (H, W)."""
    base = get_config(model_name) if model_name else SimpleNamespace(**IMAGENET, crop_pct=0.875,
                                                                             interpolation="bicubic")
    fields = {k: getattr(base, k) for k in ("mean", "std", "crop_pct", "interpolation")}
    fields["crop_mode"] = getattr(base, "crop_mode", "center")
    fields.update({k: v for k, v in given.items() if v is not None})
    if fields["crop_mode"] not in CROP_MODES:
        raise UsageError(f"crop_mode must be one of {', '.join(CROP_MODES)}, got {fields['crop_mode']!r}")
    return SimpleNamespace(img_size=check_size(img_size), in_chans=3, **fields)


def check_size(img_size) -> int | tuple[int, int]:
    """``img_size`` as given (one int, or H and W), or one line saying what it should be."""
    ok = isinstance(img_size, int) and not isinstance(img_size, bool) and img_size > 0 or \
        isinstance(img_size, (tuple, list)) and len(img_size) == 2 and \
        all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in img_size)
    if not ok:
        raise UsageError(f"img_size must be a positive int or two of them (H W, e.g. [224, 448]), got {img_size!r}")
    return img_size if isinstance(img_size, int) else (int(img_size[0]), int(img_size[1]))


def random_affine(x: Tensor, degrees: float, translate: float, scale: tuple[float, float]) -> Tensor:
    """A different random rotation, shift and zoom for every image of a batch, in one grid_sample."""
    B = x.shape[0]
    angle = (torch.rand(B, device=x.device) * 2 - 1) * math.radians(degrees)
    s = torch.empty(B, device=x.device).uniform_(*scale)
    t = (torch.rand(B, 2, device=x.device) * 2 - 1) * translate * 2  # grid coordinates span [-1, 1]
    cos, sin = angle.cos() / s, angle.sin() / s
    theta = torch.stack([torch.stack([cos, -sin, t[:, 0]], 1), torch.stack([sin, cos, t[:, 1]], 1)], 1)  # (B, 2, 3)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)
