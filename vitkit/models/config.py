"""What every model config shares: the eval-data settings, and the input check."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from torch import Tensor

from vitkit.errors import UsageError, UsageTypeError

IMAGENET = dict(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
INCEPTION = dict(mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
CLIP = dict(mean=(0.48145466, 0.4578275, 0.40821073), std=(0.26862954, 0.26130258, 0.27577711))  # OpenAI's
RAW = dict(mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))


# center: timm's resize and centre crop; squash: the whole image resized to img_size (no crop, its aspect ratio not
# kept), for images whose labels may sit anywhere in them (several labels per image)
CropMode = Literal["center", "squash"]
CROP_MODES: tuple[str, ...] = get_args(CropMode)


@dataclass
class DataConfig:
    """How images are prepared for a model at eval time (timm's ``pretrained_cfg`` fields)."""

    mean: tuple[float, ...] = IMAGENET["mean"]
    std: tuple[float, ...] = IMAGENET["std"]
    crop_pct: float = 0.875  # resize to img_size / crop_pct, then center-crop img_size
    interpolation: str = "bicubic"
    crop_mode: CropMode = "center"
    # a ViT trained on packed batches (--data.packing): predict and evaluate resize each whole image within this many
    # patches at its own aspect ratio, as the run validated it, instead of cropping it square
    max_patches: int | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_held"):
            raise AttributeError(f"{type(self).__name__}.{name}: the config of a built model is read-only, so that "
                                 f"what the model reads stays in step with it; model.configure({name}=...) changes "
                                 "both")
        super().__setattr__(name, value)


class FollowsConfig:
    """What ViT and Swin share: ``self.cfg``, whose fields ``read_config`` copies to the plain attributes that
    forward reads (and TorchScript compiles). The config is read-only once the model holds it; :meth:`configure`
    is the one way to change it, and reads it again."""

    def hold_config(self, cfg: DataConfig) -> None:
        """Take ``cfg`` as this model's config (read-only from now on) and read it."""
        cfg.__dict__["_held"] = True
        self.cfg = cfg
        self.read_config()

    def configure(self, **fields: Any) -> None:
        """Set config fields of the built model (``model.configure(dynamic_img_size=True)``); forward reads them
        from the next call. Fields that change the weights' shapes have their own methods (``set_input_size``,
        ``reset_classifier``)."""
        known = {f.name for f in dataclasses.fields(self.cfg)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise UsageError(f"{type(self.cfg).__name__} has no field(s) {unknown}")
        self.cfg.__dict__.update(fields)
        self.read_config()

    def read_config(self) -> None:
        raise NotImplementedError


def pair(x: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    return (x, x) if isinstance(x, int) else (int(x[0]), int(x[1]))


def shape_of(x: Tensor) -> str:
    """'(B, C, H, W)' of a tensor, for messages (written out, so TorchScript compiles it too)."""
    return "(" + ", ".join([str(n) for n in x.shape]) + ")"


def check_image(x: Tensor, in_chans: int, size: tuple[int, int] | None, model: str) -> None:
    """Raise a readable error for input that the model cannot take; ``size=None`` accepts any H, W."""
    expected = f"(B, {in_chans}, H, W)" if size is None else f"(B, {in_chans}, {size[0]}, {size[1]})"
    if x.dim() != 4:
        raise UsageError(f"{model} expects a batch of images {expected}, got a {x.dim()}-D tensor "
                         f"of shape {shape_of(x)}")
    if not torch.is_floating_point(x):
        raise UsageTypeError(f"{model} expects floating-point images (normalised, e.g. float32), got {x.dtype}; "
                             "convert with x.float() and normalise with the model's mean/std")
    if x.shape[0] == 0:
        raise UsageError(f"{model} got an empty batch: shape {shape_of(x)}")
    if x.shape[1] != in_chans:
        raise UsageError(f"{model} expects {in_chans} input channels {expected}, got {x.shape[1]} "
                         f"channels in shape {shape_of(x)}")
    # The finiteness check reads a value back to the host: free on CPU, a sync on every step on a GPU, so it
    # runs on CPU only (on a GPU a NaN input shows up as a non-finite loss, which training reports). One sum
    # is the cheap test (a NaN or Inf anywhere makes it non-finite); only then are they counted.
    compiling = False if torch.jit.is_scripting() else torch.compiler.is_compiling()
    if x.device.type == "cpu" and not compiling and not bool(torch.isfinite(x.sum())):
        nan, inf = int(torch.isnan(x).sum()), int(torch.isinf(x).sum())
        if nan or inf:  # else finite values whose sum overflowed
            raise UsageError(f"{model} got non-finite input: {nan} NaN and {inf} Inf value(s) in a batch of shape "
                             f"{shape_of(x)}; expected finite, normalised pixel values")
    if size is not None and (x.shape[-2] != size[0] or x.shape[-1] != size[1]):
        raise UsageError(f"{model} expects images of shape {expected}, got {shape_of(x)}; "
                         f"create the model with img_size=({x.shape[-2]}, {x.shape[-1]}) to change it")


def check_multiple(x: Tensor, patch: int) -> None:
    """With dynamic_img_size: any height and width that are multiples of the patch size."""
    if x.shape[-2] % patch or x.shape[-1] % patch:
        raise UsageError(f"VisionTransformer with dynamic_img_size takes any height and width that are "
                         f"multiples of the patch size {patch}, got {shape_of(x)}")
