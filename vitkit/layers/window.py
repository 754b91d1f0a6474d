"""Window machinery of the Swin Transformer (Liu et al., 2021): partition, cyclic shift, the shifted-window
mask, the relative-position index, and the per-block plan that ties them to a feature-map size.

Everything here moves tokens or builds masks, except :class:`WindowAttention`, which adds the relative-position
bias to the one attention core.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from .attention import Attention
from .pos_embed import resize_rel_pos_table

# the cached tables are built on the CPU whatever the default device (a model built under
# `with torch.device("meta")` must not leave meta tensors in the cache) and moved where they are used
CPU = torch.device("cpu")


def eager_cache(fn):
    """Memoise ``fn`` (of hashable arguments: sizes, plans, devices) in eager mode. Under torch.compile and
    torch.export it is called plainly: the compiler folds what it builds into constants (an lru_cache would make
    it warn), and export may pass symbolic sizes, which build their tensors in the graph."""
    cached = functools.lru_cache(maxsize=512)(fn)

    @functools.wraps(fn)
    def call(*args):
        return fn(*args) if torch.compiler.is_compiling() else cached(*args)

    call.cache_clear = cached.cache_clear
    return call


def is_symbolic(*sizes) -> bool:
    """Sizes traced as symbols (torch.export with dynamic height and width): the window machinery then
    builds its tensors in the graph from the sizes, without a Python branch on any of them."""
    return any(isinstance(s, torch.SymInt) for s in sizes)


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
    coords = torch.stack(torch.meshgrid(torch.arange(wh, device=CPU), torch.arange(ww, device=CPU),
                                        indexing="ij")).flatten(1)  # (2, N)
    rel = coords[:, :, None] - coords[:, None, :]  # (2, N, N), offsets in [-(w-1), w-1]
    return (rel[0] + th - 1) * (2 * tw - 1) + (rel[1] + tw - 1)


def _slots(padded: tuple[int, int], window: tuple[int, int], shift: tuple[int, int]) -> tuple[Tensor, ...]:
    """For each slot (window, token) of the windowed layout, (nW, N) each: its row and column in the shifted
    map, and the row and column of the padded map it holds (row i of the shifted map is row i + shift).

    Index arithmetic only, so the same code builds cached tensors in eager mode and graph nodes from symbolic
    sizes under export."""
    (Hp, Wp), (wh, ww), (sh, sw) = padded, window, shift
    nh, nw, tok = Hp // wh, Wp // ww, torch.arange(wh * ww, device=CPU)  # windows are numbered row by row
    grid = torch.zeros(nh, nw, dtype=torch.long, device=CPU)  # (a sum, not an expand: would not export symbolically)
    rows = (grid + torch.arange(nh, device=CPU)[:, None]).flatten()[:, None] * wh + tok // ww
    cols = (grid + torch.arange(nw, device=CPU)).flatten()[:, None] * ww + tok % ww
    return rows, cols, _wrap(rows + sh, Hp), _wrap(cols + sw, Wp)


def _wrap(i: Tensor, size: int) -> Tensor:
    """``i % size`` for i in [-size, 2·size), without a modulo by a size that export may trace as a symbol."""
    return i - size * (i >= size).long() + size * (i < 0).long()


@eager_cache
def shifted_window_mask(padded: tuple[int, int], window: tuple[int, int], shift: tuple[int, int],
                        valid: tuple[int, int], attend_padding: bool = False) -> Tensor | None:
    """(nW, N, N) bool, True = may attend; None when every token may attend every token of its window.

    After a cyclic shift, a window can hold tokens from up to four regions that are not neighbours in
    the image; they must not attend each other. Padding tokens (beyond ``valid`` rows/cols of the map
    before the shift) are never attended either, unless ``attend_padding`` (the official detection and
    segmentation backbone's way: padding is zero vectors that every token of its region attends)."""
    (Hp, Wp), (sh, sw), (H, W) = padded, shift, valid
    if not is_symbolic(Hp, Wp, H, W, sh, sw) and not (sh or sw) and ((Hp, Wp) == (H, W) or attend_padding):
        return None
    rows, cols, src_rows, src_cols = _slots(padded, window, shift)
    # Swin labels three bands per axis, split at -window and -shift; the first split falls between windows, so
    # within a window only the second matters: rows past Hp - shift came round from the top of the map.
    region = (rows >= Hp - sh).long() * 2 + (cols >= Wp - sw).long()  # (nW, N)
    same = region[:, :, None] == region[:, None, :]
    return same if attend_padding else same & ((src_rows < H) & (src_cols < W))[:, None, :]


@dataclass(frozen=True)
class WindowPlan:
    """How one Swin block windows a map of size (H, W): the window and shift it uses there (a window
    larger than the map shrinks to it and stops shifting, as in the official classification code; ``fixed``: the
    window and shift stay, as in the official detection and segmentation backbone) and the padding that makes the map
    a whole number of windows."""

    H: int
    W: int
    window: tuple[int, int]
    shift: tuple[int, int]

    @classmethod
    def make(cls, H: int, W: int, window: tuple[int, int], shifted: bool, fixed: bool = False) -> WindowPlan:
        if fixed:  # the configured window and shift at every size, the map padded to whole windows
            ws = tuple(window)
            return cls(H, W, ws, (ws[0] // 2, ws[1] // 2) if shifted else (0, 0))
        if is_symbolic(H, W):  # the export's size range keeps the map at least one window: shift iff larger
            ws = tuple(window)
            shift = tuple(w // 2 * torch.sym_min(n - w, 1) if shifted else 0 for n, w in zip((H, W), ws, strict=True))
        else:
            ws = (min(window[0], H), min(window[1], W))
            shift = (ws[0] // 2 if shifted and H > ws[0] else 0, ws[1] // 2 if shifted and W > ws[1] else 0)
        return cls(H, W, ws, shift)

    @property
    def padded(self) -> tuple[int, int]:
        (wh, ww) = self.window
        return (self.H + wh - 1) // wh * wh, (self.W + ww - 1) // ww * ww  # no negative operand: ONNX truncates

    def mask(self, device: torch.device, attend_padding: bool = False) -> Tensor | None:
        """(1, nW, 1, N, N) bool for the attention core, or None; built once per plan and device."""
        return _plan_mask(self.key, torch.device(device), attend_padding)

    def keep(self, device: torch.device) -> Tensor | None:
        """(1, nW, N, 1): 1 for the map's tokens, 0 for padding (None without padding): padding as zero vectors,
        for a block that attends it (``attend_padding``)."""
        return _plan_keep(self.key, torch.device(device))

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
    _, _, r, c = _slots(plan.padded, plan.window, plan.shift)
    return torch.where((r < plan.H) & (c < plan.W), r * plan.W + c, 0).flatten()


@eager_cache
def _windows_of_map(plan: WindowPlan) -> Tensor:
    """(H·W,) for each map token, its position among the windowed tokens of ``plan``."""
    (Hp, Wp), (wh, ww), (sh, sw) = plan.padded, plan.window, plan.shift
    r = _wrap(torch.arange(plan.H, device=CPU)[:, None] - sh, Hp)  # shifted
    c = _wrap(torch.arange(plan.W, device=CPU)[None, :] - sw, Wp)
    win = r // wh * (Wp // ww) + c // ww
    return (win * (wh * ww) + r % wh * ww + c % ww).flatten()


# The tensors below depend only on a plan and a device, so each is built once per plan and device, on that
# device: no host-to-device copy per forward.

PlanKey = tuple[int, int, tuple[int, int], tuple[int, int]]  # (H, W, window, shift)


@eager_cache
def _plan_mask(key: PlanKey, device: torch.device, attend_padding: bool = False) -> Tensor | None:
    plan = WindowPlan(*key)
    m = shifted_window_mask(plan.padded, plan.window, plan.shift, (plan.H, plan.W), attend_padding)
    return None if m is None else m.to(device)[None, :, None]


@eager_cache
def _plan_keep(key: PlanKey, device: torch.device) -> Tensor | None:
    plan = WindowPlan(*key)
    if not is_symbolic(*plan.padded, plan.H, plan.W) and plan.padded == (plan.H, plan.W):
        return None
    _, _, r, c = _slots(plan.padded, plan.window, plan.shift)
    return ((r < plan.H) & (c < plan.W)).float().to(device)[None, :, :, None]


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


class WindowAttention(Attention):
    """Attention within (shifted) windows with Swin's learned relative-position bias (Liu et al., 2021).

    The bias table, one value per head and 2-D offset in a ``table_window``, is this module's own (named as in
    timm's checkpoints); the caller passes ``relative_position_bias(window)`` to :meth:`forward` as the additive
    bias, so every backend runs it. x is (B, nW, N, C), the windows of a map, with an attn_mask (1, nW, 1, N, N)
    from the window plan. Subclasses change where the table comes from (:meth:`position_bias_params`,
    :meth:`bias_table`; Swin V2's is computed by an MLP)."""

    def __init__(self, dim: int, num_heads: int, table_window: tuple[int, int], **kw) -> None:
        super().__init__(dim, num_heads, **kw)
        self.rel_pos_window = tuple(table_window)
        self.position_bias_params()

    def position_bias_params(self) -> None:
        th, tw = self.rel_pos_window
        self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * th - 1) * (2 * tw - 1), self.num_heads))
        nn.init.trunc_normal_(self.relative_position_bias_table, std=0.02)

    def bias_table(self) -> Tensor:
        """((2·th - 1)·(2·tw - 1), H): the bias of each head for each 2-D offset within the table's window."""
        return self.relative_position_bias_table

    def relative_position_bias(self, window: tuple[int, int]) -> Tensor:
        """(H, N, N) bias for the token pairs of a window (<= the table's window)."""
        index = relative_position_index_on(tuple(window), self.rel_pos_window, self.proj.weight.device)
        return self._gather_bias(index, window[0] * window[1])

    def _gather_bias(self, index: Tensor, tokens: int) -> Tensor:
        """(H, N, N) from the table at an (N·N,) relative-position index."""
        return self.bias_table()[index].view(tokens, tokens, -1).permute(2, 0, 1)

    def plan(self, window: tuple[int, int], gather: Tensor, mask: Tensor | None, num_windows: int) -> None:
        """Keep the layout this block runs at its stage's configured map size as buffers (not saved): the
        gather into its windows, their mask and the bias index. TorchScript runs these, as it cannot plan
        windows from the input (see ``SwinStage.plan_windows``)."""
        index = relative_position_index_on(tuple(window), self.rel_pos_window, gather.device).clone()
        self.register_buffer("planned_gather", gather, persistent=False)
        self.register_buffer("planned_mask", mask, persistent=False)
        self.register_buffer("planned_bias_index", index, persistent=False)
        self.planned_windows, self.planned_tokens = num_windows, window[0] * window[1]

    def planned_bias(self) -> Tensor:
        """(1, 1, H, N, N): :meth:`relative_position_bias` of the planned window."""
        return self._gather_bias(self.planned_bias_index, self.planned_tokens)[None, None]

    def set_table_window(self, window: tuple[int, int]) -> None:
        """Resize the table to another window (see :func:`resize_rel_pos_table`)."""
        if tuple(window) != self.rel_pos_window:
            table = self.relative_position_bias_table
            resized = resize_rel_pos_table(table.detach(), window, self.rel_pos_window)
            self.relative_position_bias_table = nn.Parameter(resized, requires_grad=table.requires_grad)
            self.rel_pos_window = tuple(window)
