"""Window machinery of the Swin Transformer (Liu et al., 2021): partition, cyclic shift, the shifted-window
mask, the relative-position index, and the per-block plan that ties them to a feature-map size.

Everything here only moves tokens or builds masks; attention itself is :class:`vitkit.layers.Attention`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor


def eager_cache(fn):
    """Memoise ``fn`` (of hashable arguments: sizes, plans, devices) in eager mode. Under torch.compile it is
    called plainly: the compiler folds what it builds into constants, and an lru_cache would make it warn."""
    cached = functools.lru_cache(maxsize=512)(fn)

    @functools.wraps(fn)
    def call(*args):
        return fn(*args) if torch.compiler.is_compiling() else cached(*args)

    call.cache_clear = cached.cache_clear
    return call


def window_partition(x: Tensor, window: tuple[int, int]) -> Tensor:
    """(B, H, W, C) -> (B, nW, wh·ww, C); H and W must be multiples of the window."""
    wh, ww = window
    return rearrange(x, "b (nh wh) (nw ww) c -> b (nh nw) (wh ww) c", wh=wh, ww=ww)


def window_reverse(windows: Tensor, window: tuple[int, int], H: int, W: int) -> Tensor:
    """(B, nW, wh·ww, C) -> (B, H, W, C); the inverse of :func:`window_partition`."""
    wh, ww = window
    return rearrange(windows, "b (nh nw) (wh ww) c -> b (nh wh) (nw ww) c", nh=H // wh, wh=wh)


@eager_cache
def relative_position_index(window: tuple[int, int], table_window: tuple[int, int]) -> Tensor:
    """(N, N) indices into a ((2·Th−1)·(2·Tw−1)) relative-position table for a ``window`` <= ``table_window``.

    With window == table_window this is Swin's index; a smaller window (a feature map smaller than
    the configured window) reads the central part of the same table."""
    wh, ww = window
    th, tw = table_window
    coords = torch.stack(torch.meshgrid(torch.arange(wh), torch.arange(ww), indexing="ij")).flatten(1)  # (2, N)
    rel = coords[:, :, None] - coords[:, None, :]  # (2, N, N), offsets in [-(w-1), w-1]
    return (rel[0] + th - 1) * (2 * tw - 1) + (rel[1] + tw - 1)


def _region_ids(size: int, window: int, shift: int) -> Tensor:
    """Which of the three cyclic-shift regions each row (or column) of the padded map belongs to."""
    ids = torch.zeros(size, dtype=torch.long)
    if shift:
        ids[size - window: size - shift] = 1
        ids[size - shift:] = 2
    return ids


@eager_cache
def shifted_window_mask(padded: tuple[int, int], window: tuple[int, int], shift: tuple[int, int],
                        valid: tuple[int, int]) -> Tensor | None:
    """(nW, N, N) bool, True = may attend; None when every token may attend every token of its window.

    After a cyclic shift, a window can hold tokens from up to four regions that are not neighbours in
    the image; they must not attend each other. Padding tokens (beyond ``valid`` rows/cols of the map
    before the shift) are never attended either."""
    (Hp, Wp), (wh, ww), (sh, sw), (H, W) = padded, window, shift, valid
    if not (sh or sw) and (Hp, Wp) == (H, W):
        return None
    rows, cols = _region_ids(Hp, wh, sh), _region_ids(Wp, ww, sw)
    region = (rows[:, None] * 3 + cols[None, :])[None, :, :, None]  # (1, Hp, Wp, 1)
    real = torch.zeros(Hp, Wp, dtype=torch.bool)
    real[:H, :W] = True
    real = torch.roll(real, shifts=(-sh, -sw), dims=(0, 1))[None, :, :, None]  # where real tokens land
    region = window_partition(region, window)[0, :, :, 0]  # (nW, N)
    real = window_partition(real, window)[0, :, :, 0]  # (nW, N)
    return (region[:, :, None] == region[:, None, :]) & real[:, None, :]


@dataclass(frozen=True)
class WindowPlan:
    """How one Swin block windows a map of size (H, W): the window and shift it uses there (a window
    larger than the map shrinks to it and stops shifting, as in the official code) and the padding
    that makes the map a whole number of windows."""

    H: int
    W: int
    window: tuple[int, int]
    shift: tuple[int, int]

    @classmethod
    def make(cls, H: int, W: int, window: tuple[int, int], shifted: bool) -> WindowPlan:
        ws = (min(window[0], H), min(window[1], W))
        shift = (ws[0] // 2 if shifted and H > ws[0] else 0, ws[1] // 2 if shifted and W > ws[1] else 0)
        return cls(H, W, ws, shift)

    @property
    def padded(self) -> tuple[int, int]:
        (wh, ww) = self.window
        return math.ceil(self.H / wh) * wh, math.ceil(self.W / ww) * ww

    def mask(self, device: torch.device) -> Tensor | None:
        """(1, nW, 1, N, N) bool for the attention core, or None; built once per plan and device."""
        return _plan_mask(self.key, torch.device(device))

    @property
    def key(self) -> PlanKey:
        return (self.H, self.W, tuple(self.window), tuple(self.shift))

    def partition(self, x: Tensor) -> Tensor:
        """(B, H, W, C) -> (B, nW, N, C): pad to whole windows, shift, cut into windows."""
        Hp, Wp = self.padded
        if (Hp, Wp) != (self.H, self.W):
            x = F.pad(x, (0, 0, 0, Wp - self.W, 0, Hp - self.H))
        if any(self.shift):
            x = torch.roll(x, shifts=(-self.shift[0], -self.shift[1]), dims=(1, 2))
        return window_partition(x, self.window)

    def reverse(self, windows: Tensor) -> Tensor:
        """(B, nW, N, C) -> (B, H, W, C): undo :meth:`partition`."""
        x = window_reverse(windows, self.window, *self.padded)
        if any(self.shift):
            x = torch.roll(x, shifts=self.shift, dims=(1, 2))
        return x[:, : self.H, : self.W]

    @property
    def num_windows(self) -> int:
        return (self.padded[0] // self.window[0]) * (self.padded[1] // self.window[1])


# Between two blocks, "reverse the windows of block j, then partition for block j+1" only reorders tokens
# (pad, roll and cut are all permutations, up to padding). One precomputed gather does it in a single
# copy instead of the four (roll, pad, partition, reverse) a straightforward block makes.


@eager_cache
def _map_of_windows(plan: WindowPlan) -> Tensor:
    """(nW·N,) for each windowed token of ``plan``, its index in the flattened (H·W) map; padding -> 0
    (any real token will do: padded keys are masked and padded queries are cut off)."""
    idx = torch.arange(plan.H * plan.W).view(1, plan.H, plan.W, 1)
    return plan.partition(idx).flatten()  # partition pads with zeros


@eager_cache
def _windows_of_map(plan: WindowPlan) -> Tensor:
    """(H·W,) for each map token, its position among the windowed tokens of ``plan``."""
    pos = torch.arange(plan.padded[0] * plan.padded[1]).view(1, plan.num_windows, -1, 1)  # (1, nW, N, 1)
    return plan.reverse(pos).flatten()


# The tensors below depend only on a plan and a device, so each is built once per plan and device, on that
# device: no host-to-device copy per forward.

PlanKey = tuple[int, int, tuple[int, int], tuple[int, int]]  # (H, W, window, shift)


@eager_cache
def _plan_mask(key: PlanKey, device: torch.device) -> Tensor | None:
    plan = WindowPlan(*key)
    m = shifted_window_mask(plan.padded, plan.window, plan.shift, (plan.H, plan.W))
    return None if m is None else m.to(device)[None, :, None]


@eager_cache
def _token_index(src: PlanKey | None, dst: PlanKey | None, device: torch.device) -> Tensor:
    if src is None:
        idx = _map_of_windows(WindowPlan(*dst))
    elif dst is None:
        idx = _windows_of_map(WindowPlan(*src))
    else:
        idx = _windows_of_map(WindowPlan(*src))[_map_of_windows(WindowPlan(*dst))]
    return idx.to(device)


def token_index(src: WindowPlan | None, dst: WindowPlan | None, device: torch.device) -> Tensor:
    """Gather index along the token axis from the ``src`` layout to the ``dst`` layout of the same map;
    None stands for the plain row-major (H·W) map."""
    return _token_index(None if src is None else src.key, None if dst is None else dst.key, torch.device(device))


@eager_cache
def relative_position_index_on(window: tuple[int, int], table_window: tuple[int, int], device: torch.device) -> Tensor:
    """:func:`relative_position_index` on ``device``, flattened."""
    return relative_position_index(window, table_window).view(-1).to(device)
