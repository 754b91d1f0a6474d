"""DINO's multi-crop augmentation (Caron et al., 2021), on a batch, on the device it trains on: from each image, G
global crops (a large share of the image) and L local crops (a small share, smaller in pixels), each flipped, colour
jittered, sometimes grey, blurred and (the second global crop) solarised, as DINO's and DINOv2's recipes do.

It takes the batches every vitkit data module already gives (normalised, one view per image), so a folder, a
stream, a Hugging Face dataset or the digits serve DINO unchanged; the data module's own augmentation should then be
light (a crop of most of the image). The crops are resampled bilinearly by one ``grid_sample`` per view; the colour
operations are per-image tensor arithmetic (the hue turn is a rotation in YIQ space).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from vitkit.errors import UsageError

# RGB -> YIQ and back: hue is the angle of (I, Q), so a hue shift is a rotation of that plane
RGB_TO_YIQ = torch.tensor([[0.299, 0.587, 0.114], [0.596, -0.274, -0.322], [0.211, -0.523, 0.312]])
GREY = torch.tensor([0.299, 0.587, 0.114])


@dataclass
class MultiCrop:
    """The crops' sizes and shares of the image, and the colour operations' strengths and probabilities (DINO's:
    brightness 0.4, contrast 0.4, saturation 0.2, hue 0.1 with probability 0.8; grey 0.2; blur always on the
    first global crop, 0.1 on the second and 0.5 on the local ones, sigma 0.1 to 2 px at 224 px; solarisation 0.2
    on the second global crop)."""

    global_size: int = 224
    local_size: int = 96
    global_crops: int = 2
    local_crops: int = 8
    global_scale: tuple[float, float] = (0.32, 1.0)
    local_scale: tuple[float, float] = (0.05, 0.32)
    flip: float = 0.5
    jitter: float = 0.8
    brightness: float = 0.4
    contrast: float = 0.4
    saturation: float = 0.2
    hue: float = 0.1
    grey: float = 0.2
    blur: tuple[float, float, float] = (1.0, 0.1, 0.5)  # first global, other globals, locals
    blur_sigma: tuple[float, float] = (0.1, 2.0)  # in pixels of a 224 px crop; scaled with the crop's size
    solarize: float = 0.2  # the second global crop's

    def __post_init__(self) -> None:
        if self.global_crops < 1 or self.local_crops < 0 or self.global_crops + self.local_crops < 2:
            raise UsageError(f"multi-crop needs a global crop and two crops at least, got {self.global_crops} global "
                             f"and {self.local_crops} local")
        if min(self.global_size, self.local_size) < 1:
            raise UsageError(f"crop sizes must be >= 1 px, got global_size={self.global_size}, "
                             f"local_size={self.local_size}")
        probabilities = {"jitter": self.jitter, "grey": self.grey, "solarize": self.solarize,
                         **{f"blur[{i}]": b for i, b in enumerate(self.blur)}}
        for name, prob in probabilities.items():
            if not 0 <= prob <= 1:
                raise UsageError(f"{name} is a probability, in [0, 1], got {prob}")
        for name in ("global_scale", "local_scale"):
            lo, hi = getattr(self, name)
            if not 0 < lo <= hi <= 1:
                raise UsageError(f"{name} must be (low, high) with 0 < low <= high <= 1, got {(lo, hi)}")

    def __call__(self, images: Tensor, mean: Tensor, std: Tensor,
                 generator: torch.Generator | None = None) -> tuple[Tensor, Tensor | None]:
        """Normalised images (B, c, H, W) -> global crops (G, B, c, S, S) and local crops (L, B, c, s, s) or None,
        normalised alike. ``mean``, ``std``: (c,) the normalisation's."""
        x = images.float() * std.view(1, -1, 1, 1) + mean.view(1, -1, 1, 1)  # pixels in [0, 1]
        views = []
        for v in range(self.global_crops + self.local_crops):
            is_global = v < self.global_crops
            size, scale = (self.global_size, self.global_scale) if is_global else (self.local_size, self.local_scale)
            crop = resized_crops(x, size, scale, self.flip, generator)
            crop = self.colour(crop, generator)
            blur = self.blur[0] if v == 0 else self.blur[1] if is_global else self.blur[2]
            sigma = tuple(s * size / 224 for s in self.blur_sigma)
            crop = gaussian_blur(crop, blur, sigma, generator)
            if v == 1:
                crop = solarize(crop, self.solarize, generator)
            views.append((crop - mean.view(1, -1, 1, 1)) / std.view(1, -1, 1, 1))
        local = torch.stack(views[self.global_crops:]) if self.local_crops else None
        return torch.stack(views[: self.global_crops]), local

    def native(self, images: list[Tensor], mean: Tensor, std: Tensor, patch_size: int,
               generator: torch.Generator | None = None) -> tuple[list[Tensor], list[Tensor]]:
        """:meth:`__call__` for images of their own sizes (normalised (c, H, W) each): every crop keeps its own
        aspect ratio, resized to the largest size within the patch budget of a ``global_size`` (or ``local_size``)
        square crop (:func:`~vitkit.patch_budget.budget_size`). Returns the global crops and the local crops, view by
        view (crop ``v·B + b`` of image b), normalised alike."""
        from vitkit.patch_budget import budget_size

        mean, std = mean.view(1, -1, 1, 1), std.view(1, -1, 1, 1)
        pixels = [img[None].float() * std + mean for img in images]
        views: list[list[Tensor]] = []
        for v in range(self.global_crops + self.local_crops):
            is_global = v < self.global_crops
            size, scale = (self.global_size, self.global_scale) if is_global else (self.local_size, self.local_scale)
            budget = (size // patch_size) ** 2
            crops = []
            for x in pixels:
                box = _boxes(1, x, scale, self.flip, generator)
                H, W = x.shape[-2:]
                out = budget_size(max(1, round(float(box[1]) * H)), max(1, round(float(box[0]) * W)), patch_size,
                                  budget)
                crop = self.colour(_sample(x, box, out), generator)
                blur = self.blur[0] if v == 0 else self.blur[1] if is_global else self.blur[2]
                side = math.sqrt(out[0] * out[1])
                crop = gaussian_blur(crop, blur, tuple(s * side / 224 for s in self.blur_sigma), generator)
                if v == 1:
                    crop = solarize(crop, self.solarize, generator)
                crops.append(((crop - mean) / std)[0])
            views.append(crops)
        flat = [[c for view in part for c in view] for part in (views[: self.global_crops], views[self.global_crops:])]
        return flat[0], flat[1]

    def colour(self, x: Tensor, generator: torch.Generator | None) -> Tensor:
        """Colour jitter (with probability ``jitter``: brightness, contrast, saturation, hue), then grey."""
        B = x.shape[0]
        if x.shape[1] != 3:  # one channel: brightness and contrast only
            return _contrast(_brightness(x, self._factors(B, self.brightness, x, generator)),
                             self._factors(B, self.contrast, x, generator)).clamp(0, 1)
        on = _draw(B, x, generator) < self.jitter
        y = _brightness(x, self._factors(B, self.brightness, x, generator))
        y = _contrast(y, self._factors(B, self.contrast, x, generator))
        y = _saturation(y, self._factors(B, self.saturation, x, generator))
        y = _hue(y, (2 * _draw(B, x, generator) - 1) * self.hue)
        x = torch.where(on.view(B, 1, 1, 1), y, x)
        grey = (x * GREY.to(x).view(1, 3, 1, 1)).sum(1, keepdim=True).expand_as(x)
        return torch.where((_draw(B, x, generator) < self.grey).view(B, 1, 1, 1), grey, x)

    @staticmethod
    def _factors(B: int, strength: float, x: Tensor, generator: torch.Generator | None) -> Tensor:
        return 1 + (2 * _draw(B, x, generator) - 1) * strength  # uniform in [1 - strength, 1 + strength]


def _draw(n: int, like: Tensor, generator: torch.Generator | None) -> Tensor:
    """n uniform numbers, drawn on the CPU (the same draws on every device) and moved to ``like``'s."""
    return torch.rand(n, generator=generator).to(like.device)


def resized_crops(x: Tensor, size: int, scale: tuple[float, float], flip: float,
                  generator: torch.Generator | None = None, ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> Tensor:
    """One RandomResizedCrop per image of ``x`` (B, c, H, W): a share of the area in ``scale`` at an aspect ratio
    in ``ratio`` (log-uniform), anywhere inside the image, flipped with probability ``flip``, resampled to
    ``size`` x ``size``."""
    return _sample(x, _boxes(x.shape[0], x, scale, flip, generator, ratio), (size, size))


def _boxes(B: int, x: Tensor, scale: tuple[float, float], flip: float, generator: torch.Generator | None,
           ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> Tensor:
    """B crops of the images ``x``: (width and height as fractions of the image's, centre x and y in
    ``grid_sample``'s [-1, 1], the flip's sign), (5, B)."""
    H, W = x.shape[-2:]
    area = scale[0] + (scale[1] - scale[0]) * _draw(B, x, generator)
    log_r = math.log(ratio[0]) + (math.log(ratio[1]) - math.log(ratio[0])) * _draw(B, x, generator)
    aspect = torch.exp(log_r) * H / W  # the crop's width / height in pixels is exp(log_r)
    w = torch.sqrt(area * aspect).clamp(max=1.0)  # fractions of the image's width and height
    h = torch.sqrt(area / aspect).clamp(max=1.0)
    cx = (2 * _draw(B, x, generator) - 1) * (1 - w)  # the centre, in grid_sample's [-1, 1] coordinates
    cy = (2 * _draw(B, x, generator) - 1) * (1 - h)
    sign = torch.where(_draw(B, x, generator) < flip, -1.0, 1.0).to(x.device)
    return torch.stack([w, h, cx, cy, sign])


def _sample(x: Tensor, box: Tensor, size: tuple[int, int]) -> Tensor:
    """The crops ``box`` (:func:`_boxes`) of ``x`` (B, c, H, W), resampled bilinearly to ``size`` (h, w)."""
    w, h, cx, cy, sign = box
    zero = torch.zeros_like(w)
    theta = torch.stack([torch.stack([w * sign, zero, cx], 1), torch.stack([zero, h, cy], 1)], 1)  # (B, 2, 3)
    grid = F.affine_grid(theta.to(x.dtype), [x.shape[0], x.shape[1], *size], align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)


def _brightness(x: Tensor, f: Tensor) -> Tensor:
    return (x * f.view(-1, 1, 1, 1)).clamp(0, 1)


def _contrast(x: Tensor, f: Tensor) -> Tensor:
    grey = (x * GREY.to(x).view(1, -1, 1, 1)).sum(1, keepdim=True) if x.shape[1] == 3 else x
    mean = grey.mean(dim=(1, 2, 3), keepdim=True)
    return (mean + (x - mean) * f.view(-1, 1, 1, 1)).clamp(0, 1)


def _saturation(x: Tensor, f: Tensor) -> Tensor:
    grey = (x * GREY.to(x).view(1, 3, 1, 1)).sum(1, keepdim=True)
    return (grey + (x - grey) * f.view(-1, 1, 1, 1)).clamp(0, 1)


def _hue(x: Tensor, shift: Tensor) -> Tensor:
    """Turn each image's hue by ``shift`` (B,) of a full turn."""
    to_yiq = RGB_TO_YIQ.to(x)
    yiq = torch.einsum("ij,bjhw->bihw", to_yiq, x)
    a = shift * 2 * math.pi
    cos, sin = torch.cos(a).view(-1, 1, 1), torch.sin(a).view(-1, 1, 1)
    i, q = yiq[:, 1], yiq[:, 2]
    yiq = torch.stack([yiq[:, 0], i * cos - q * sin, i * sin + q * cos], 1)
    return torch.einsum("ij,bjhw->bihw", torch.linalg.inv(to_yiq), yiq).clamp(0, 1)


def gaussian_blur(x: Tensor, p: float, sigma: tuple[float, float], generator: torch.Generator | None = None) -> Tensor:
    """Blur each image with probability ``p`` by a Gaussian of a sigma drawn uniformly in ``sigma`` (pixels)."""
    B, c, H, W = x.shape
    if p <= 0:
        return x
    on = _draw(B, x, generator) < p
    s = sigma[0] + (sigma[1] - sigma[0]) * _draw(B, x, generator)
    radius = max(1, min(math.ceil(3 * sigma[1]), (min(H, W) - 1) // 2))
    taps = torch.arange(-radius, radius + 1, device=x.device, dtype=x.dtype)
    k = torch.exp(-0.5 * (taps[None] / s[:, None]) ** 2)
    k = (k / k.sum(1, keepdim=True)).repeat_interleave(c, 0)  # (B·c, taps): one kernel per image, every channel
    y = x.reshape(1, B * c, H, W)
    y = F.conv2d(F.pad(y, (radius, radius, 0, 0), mode="reflect"), k.view(B * c, 1, 1, -1), groups=B * c)
    y = F.conv2d(F.pad(y, (0, 0, radius, radius), mode="reflect"), k.view(B * c, 1, -1, 1), groups=B * c)
    return torch.where(on.view(B, 1, 1, 1), y.view(B, c, H, W), x)


def solarize(x: Tensor, p: float, generator: torch.Generator | None = None) -> Tensor:
    """With probability ``p`` per image, invert the pixels at or above half intensity (PIL's solarize at 128)."""
    on = (_draw(x.shape[0], x, generator) < p).view(-1, 1, 1, 1)
    return torch.where(on & (x >= 0.5), 1 - x, x)
