"""How RF-DETR reads its backbone: the maps (B, C, h, w) of the stages of ``out_indices``, from a ViT with a class
token in RF-DETR's windows (:class:`WindowedViT`, DINOv2's and the other class-token ViTs, registers and rotary
positions carried), from a ViT without one in LW-DETR's (:class:`WindowedPlainViT`), or from a backbone of stages
(:class:`StagedMaps`, Swin). None holds weights: the backbone is the detector's."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vitkit.errors import UsageError
from vitkit.layers.pos_embed import rope_rows


def _check_windowable(vit: nn.Module, who: str, out_indices: tuple[int, ...]) -> None:
    """One line where a backbone's blocks cannot run in windows (token merging, which changes the token count block
    by block), or where ``out_indices`` name no stage of it."""
    if getattr(getattr(vit, "cfg", None), "token_merging", 0):
        raise UsageError(f"{who} runs its backbone's blocks in windows, without token merging; "
                         f"{getattr(vit, 'name', type(vit).__name__)} has token_merging={vit.cfg.token_merging!r}")
    depth = len(vit.blocks)
    if min(out_indices) < 1 or max(out_indices) > depth:
        raise UsageError(f"out_indices must be stages 1 to {depth} (the backbone's blocks), got {out_indices}")


def _check_input(who: str, patch: int, windows: int, H: int, W: int) -> None:
    """One line where an image is not whole windows of whole patches."""
    if H % (patch * windows) or W % (patch * windows):
        raise UsageError(f"{who} takes images whose height and width are multiples of {patch * windows} px (the "
                         f"{patch} px patch x {windows} windows), got {H} x {W}")


class WindowedViT:
    """How RF-DETR runs a vitkit ViT with a class token as its windowed DINOv2 (module docstring): images
    (B, 3, H, W), H and W multiples of ``windows`` x the patch -> one map (B, C, h, w) per stage of ``out_indices``.

    Each window holds the prefix tokens (the class token, and registers where the ViT has them, as DINOv2-reg and
    DINOv3) and its patches; rotary positions (DINOv3's, EVA-02's) go with each patch into its window and into the
    global blocks, which attend over every window's tokens at once, as RF-DETR's do. It holds no weights: the ViT
    is the detector's ``backbone``."""

    def __init__(self, vit: nn.Module, out_indices: tuple[int, ...], windows: int,
                 window_blocks: tuple[int, ...] | None = None) -> None:
        if getattr(vit, "cls_token", None) is None or not hasattr(vit, "embed_tokens"):
            raise UsageError(f"RF-DETR's backbone is a ViT with a class token; "
                             f"{getattr(vit, 'name', type(vit).__name__)} is not")
        _check_windowable(vit, "RF-DETR", out_indices)
        self.out_indices, self.windows, depth = tuple(out_indices), windows, len(vit.blocks)
        if windows == 1:
            self.global_blocks = set(range(depth))
        elif window_blocks is None:  # RF-DETR's rule
            self.global_blocks = set(self.out_indices)
        else:
            self.global_blocks = set(range(depth)) - set(window_blocks)

    def partition(self, x: Tensor, grid: tuple[int, int], prefix: int) -> Tensor:
        """(B, P + h·w, C) -> (B·n², P + h·w / n², C): RF-DETR's window split, the P prefix tokens in each window."""
        B, _, C = x.shape
        n, (h, w) = self.windows, grid
        head, patches = x[:, :prefix], x[:, prefix:]
        patches = patches.reshape(B, n, w // n, n, h // n, C).transpose(2, 3)  # (B, n, n, w/n, h/n, C): theirs
        patches = patches.reshape(B * n * n, (h // n) * (w // n), C)
        return torch.cat([head.repeat_interleave(n * n, dim=0), patches], dim=1)

    def unpartition(self, x: Tensor, B: int, grid: tuple[int, int]) -> Tensor:
        """(B·n², h·w / n², C) patch tokens -> a map (B, C, h, w), as RF-DETR reassembles it."""
        n, (h, w), C = self.windows, grid, x.shape[-1]
        x = x.reshape(B, n, n, h // n, w // n, C).transpose(2, 3)  # (B, n, h/n, n, w/n, C)
        return x.reshape(B, h, w, C).permute(0, 3, 1, 2).contiguous()

    def __call__(self, vit: nn.Module, x: Tensor) -> list[Tensor]:
        p, n, P = vit.patch_size, self.windows, vit.num_prefix_tokens
        B, _, H, W = x.shape
        _check_input("RF-DETR", p, n, H, W)
        grid = (H // p, W // p)
        tokens, rope = vit.embed_tokens(vit.patch_embed(x), grid, resample=True)  # (B, P + h·w, C)
        state = self.partition(tokens, grid, P) if n > 1 else tokens  # (B·n², L, C)
        ropes = self._ropes(rope, grid, P, B, state.shape[1], tokens.device)
        states = {0: state}
        for i, blk in enumerate(vit.blocks[:max(self.out_indices)]):  # the blocks after the last stage read: unused
            if i in self.global_blocks and n > 1:  # every window's tokens in one sequence (norms, MLP per token)
                state = blk(state.reshape(B, -1, state.shape[-1]), rope=vit._layer_rope(ropes[1], i))
                state = state.reshape(B * n * n, -1, state.shape[-1])
            else:
                state = blk(state, rope=vit._layer_rope(ropes[0], i))
            if i + 1 in self.out_indices:
                states[i + 1] = state
        maps = []
        for k in self.out_indices:
            tokens = vit.norm(states[k])[:, P:]
            maps.append(self.unpartition(tokens, B, grid) if n > 1 else
                        tokens.reshape(B, grid[0], grid[1], -1).permute(0, 3, 1, 2).contiguous())
        return maps

    def _ropes(self, rope, grid: tuple[int, int], prefix: int, B: int, length: int, device) -> tuple:
        """The RoPE tables (or None) of the windows' sequences (B·n², L) and of the global blocks' (B, n²·L): each
        token's own row, the prefix tokens' in every window."""
        if rope is None or self.windows == 1:
            return rope, rope
        index = torch.arange(prefix + grid[0] * grid[1], device=device, dtype=torch.float32)[None, :, None]
        rows = self.partition(index, grid, prefix)[..., 0].long()  # (n², L): each window's token indices
        return rope_rows(rope, rows.repeat(B, 1)), rope_rows(rope, rows.reshape(1, -1).repeat(B, 1))


class WindowedPlainViT:
    """How LW-DETR runs a vitkit ViT without a class token (its own ViT, CAE-pretrained): the patches and positions
    (resampled bicubic) split into ``windows`` x ``windows`` windows of the image; the blocks of ``window_blocks``
    attend within their window, the others across all; the maps are the states after ``out_indices`` blocks, as they
    are (no final norm). It holds no weights: the ViT is the detector's ``backbone``."""

    def __init__(self, vit: nn.Module, out_indices: tuple[int, ...], windows: int,
                 window_blocks: tuple[int, ...] | None = None) -> None:
        if getattr(vit, "num_prefix_tokens", 1) != 0 or getattr(vit, "pos_embed", None) is None or \
                getattr(getattr(vit, "cfg", None), "rope", ""):
            raise UsageError(f"LW-DETR's backbone is a ViT with learned positions, no rotary ones and no class token; "
                             f"{getattr(vit, 'name', type(vit).__name__)} is not")
        _check_windowable(vit, "LW-DETR", out_indices)
        self.out_indices, self.windows = tuple(out_indices), windows
        rule = set(range(max(out_indices))) - {i for i in out_indices}  # RF-DETR's, where none are named
        self.window_blocks = set(rule if window_blocks is None else window_blocks) if windows > 1 else set()

    def __call__(self, vit: nn.Module, x: Tensor) -> list[Tensor]:
        p, n = vit.patch_size, self.windows
        B, _, H, W = x.shape
        _check_input("LW-DETR", p, n, H, W)
        h, w = H // p, W // p
        tokens = vit.norm_pre(vit.pos_drop(vit.patch_embed(x) + vit.positions_for((h, w))))  # (B, h·w, C)
        C = tokens.shape[-1]
        state = tokens.reshape(B, n, h // n, n, w // n, C).transpose(2, 3).reshape(B * n * n, -1, C)  # windows
        maps = []
        for i, blk in enumerate(vit.blocks[:max(self.out_indices)]):
            state = blk(state) if i in self.window_blocks else blk(state.reshape(B, -1, C)).reshape(state.shape)
            if i + 1 in self.out_indices:
                grid = state.reshape(B, n, n, h // n, w // n, C).transpose(2, 3).reshape(B, h, w, C)
                maps.append(grid.permute(0, 3, 1, 2).contiguous())  # (B, C, h, w)
        return maps


class StagedMaps:
    """How RF-DETR reads a backbone of stages (Swin): the outputs of the stages of ``out_indices`` (stage k: after k
    stages, at its ``feature_info`` reduction), each brought to the grid of the read stage nearest stride 16 (RF-DETR's
    level, P4), finer maps averaged over their cells, coarser ones upsampled bilinearly. Swin's windows are its own:
    RF-DETR's ``windows`` are a plain ViT's. It holds no weights: the backbone is the detector's."""

    def __init__(self, net: nn.Module, out_indices: tuple[int, ...], window_blocks: tuple[int, ...] | None) -> None:
        depth, name = len(net.layers), getattr(net, "name", type(net).__name__)
        if min(out_indices) < 1 or max(out_indices) > depth:
            raise UsageError(f"out_indices must be stages 1 to {depth} ({name}'s stages), got {tuple(out_indices)}")
        if window_blocks is not None:
            raise UsageError(f"window_blocks name a plain ViT's blocks that attend in windows; {name} has windows of "
                             f"its own (give none)")
        if getattr(net.cfg, "token_merging", 0):
            raise UsageError(f"RF-DETR reads {name} without token merging")
        self.out_indices, self.name = tuple(out_indices), name
        stages = [net.feature_info[k - 1] for k in self.out_indices]  # the backbone's own: channels, reduction
        self.strides, self.widths = [s["reduction"] for s in stages], [s["num_chs"] for s in stages]
        self.stride = min(self.strides, key=lambda s: (abs(math.log2(s / 16)), s))
        self.multiple = max(self.strides)  # every read map a whole number of the reference's cells

    def rule(self) -> str:
        return f"the stride of {self.name}'s stage {max(self.out_indices)}"

    def __call__(self, net: nn.Module, x: Tensor) -> list[Tensor]:
        H, W = x.shape[-2:]
        if H % self.multiple or W % self.multiple:
            raise UsageError(f"RF-DETR takes images whose height and width are multiples of {self.multiple} px "
                             f"({self.rule()}), got {H} x {W}")
        maps = net.forward_intermediates(x, indices=[k - 1 for k in self.out_indices], stop_early=True,
                                         intermediates_only=True)
        out = []
        for m, s in zip(maps, self.strides, strict=True):
            if s < self.stride:
                m = F.avg_pool2d(m, self.stride // s)
            elif s > self.stride:
                m = F.interpolate(m, scale_factor=s // self.stride, mode="bilinear", align_corners=False)
            out.append(m)
        return out
