"""Swin Transformer (Liu et al., 2021) on the shared attention core, timm-compatible.

A Swin block is the ordinary :class:`vitkit.layers.Block` run on windows: layer norm and MLP act per
token, so cutting the map into (shifted) windows before the block and stitching it after is the same
as windowing only the attention. Windows are folded into the attention's group axis, so the relative
position bias and the shift mask broadcast over the batch inside the fused kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..layers import AttnBackend, Block, PatchEmbed, drop_path_rates
from ..layers.attention import check_backend
from ..layers.window import WindowPlan, token_index
from .config import IMAGENET, DataConfig, check_image, pair


@dataclass
class SwinConfig(DataConfig):
    """Everything that defines a Swin; presets below are rows of overrides to it."""

    img_size: int | tuple[int, int] = 224  # the size the windows are planned for; other sizes are padded
    patch_size: int = 4
    in_chans: int = 3
    num_classes: int = 1000
    embed_dim: int = 96  # doubles at every stage
    depths: tuple[int, ...] = (2, 2, 6, 2)
    num_heads: tuple[int, ...] = (3, 6, 12, 24)
    window_size: int | tuple[int, ...] = 7  # one for all stages, or one per stage
    mlp_ratio: float = 4.0
    qkv_bias: bool = True
    norm_eps: float = 1e-5
    drop_rate: float = 0.0
    proj_drop_rate: float = 0.0
    attn_drop_rate: float = 0.0
    drop_path_rate: float = 0.1
    attn_backend: AttnBackend = "sdpa"
    crop_pct: float = 0.9

    def __post_init__(self) -> None:
        check_backend(self.attn_backend)
        self.depths, self.num_heads = tuple(self.depths), tuple(self.num_heads)
        if len(self.depths) != len(self.num_heads):
            raise ValueError(f"depths {self.depths} and num_heads {self.num_heads} need one entry per stage")
        if len(self.stage_windows) != len(self.depths):
            raise ValueError(f"window_size {self.window_size} needs one entry per stage ({len(self.depths)})")

    @property
    def stage_windows(self) -> tuple[int, ...]:
        ws = self.window_size
        return (ws,) * len(self.depths) if isinstance(ws, int) else tuple(ws)

    @property
    def stage_sizes(self) -> list[tuple[int, int]]:
        """Feature-map size of each stage at ``img_size``; patch merging rounds odd sizes up."""
        h, w = (-(-s // self.patch_size) for s in pair(self.img_size))
        sizes = []
        for i in range(len(self.depths)):
            if i:
                h, w = -(-h // 2), -(-w // 2)
            sizes.append((h, w))
        return sizes


class PatchMerging(nn.Module):
    """2x2 neighbouring patches -> LayerNorm -> Linear 4C -> 2C (odd sizes are zero-padded first)."""

    def __init__(self, dim: int, out_dim: int, eps: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4 * dim, eps=eps)
        self.reduction = nn.Linear(4 * dim, out_dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        B, H, W, C = x.shape
        if H % 2 or W % 2:
            x = F.pad(x, (0, 0, 0, W % 2, 0, H % 2))
            H, W = H + H % 2, W + W % 2
        # (B, H/2, W/2, 4C); the four neighbours in timm's order (0,0), (1,0), (0,1), (1,1)
        x = x.reshape(B, H // 2, 2, W // 2, 2, C).permute(0, 1, 3, 4, 2, 5).flatten(3)
        return self.reduction(self.norm(x))


class SwinStage(nn.Module):
    """Optional patch merging, then blocks alternating regular and shifted windows."""

    def __init__(self, cfg: SwinConfig, i: int, dim: int, out_dim: int, drop_path: list[float]) -> None:
        super().__init__()
        H, W = cfg.stage_sizes[i]
        w = cfg.stage_windows[i]
        self.window = (min(w, H), min(w, W))  # a window larger than the map shrinks to it
        self.downsample = PatchMerging(dim, out_dim, cfg.norm_eps) if i else nn.Identity()
        self.blocks = nn.Sequential(*[
            Block(out_dim, cfg.num_heads[i], mlp_ratio=cfg.mlp_ratio, qkv_bias=cfg.qkv_bias, drop=cfg.proj_drop_rate,
                  attn_drop=cfg.attn_drop_rate, drop_path=dp, norm_eps=cfg.norm_eps, rel_pos_window=self.window,
                  attn_backend=cfg.attn_backend)
            for dp in drop_path
        ])

    def forward(self, x: Tensor) -> Tensor:
        x = self.downsample(x)
        B, H, W, C = x.shape
        plans = [WindowPlan.make(H, W, self.window, shifted=j % 2 == 1) for j in range(len(self.blocks))]
        # Tokens stay in window order from block to block: each hand-over (un-shift, re-shift, re-cut)
        # is one gather along the token axis; see WindowPlan.partition/reverse for the same in steps.
        x = x.reshape(B, H * W, C)
        prev = None
        for blk, plan in zip(self.blocks, plans, strict=True):
            x = x.index_select(1, token_index(prev, plan, x.device))  # (B, nW·N, C)
            bias = blk.attn.relative_position_bias(plan.window)[None, None]  # (1, 1, heads, N, N)
            x = blk(x.view(B, plan.num_windows, -1, C), bias=bias, attn_mask=plan.mask(x.device))
            x, prev = x.flatten(1, 2), plan
        return x.index_select(1, token_index(prev, None, x.device)).view(B, H, W, C)


class PoolHead(nn.Module):
    """Global average pool over the map, dropout, linear classifier (``head.fc`` as in timm)."""

    def __init__(self, dim: int, num_classes: int, drop: float) -> None:
        super().__init__()
        self.drop = nn.Dropout(drop)
        self.fc = nn.Linear(dim, num_classes) if num_classes > 0 else nn.Identity()

    def forward(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        x = self.drop(x.mean(dim=(1, 2)))  # (B, C)
        return x if pre_logits else self.fc(x)


class SwinTransformer(nn.Module):
    """Hierarchical vision transformer with (shifted) window attention."""

    def __init__(self, cfg: SwinConfig) -> None:
        super().__init__()
        self.cfg = cfg
        dims = [cfg.embed_dim * 2**i for i in range(len(cfg.depths))]
        self.num_features = dims[-1]
        self.patch_embed = PatchEmbed(cfg.patch_size, cfg.in_chans, dims[0], norm=True, flatten=False,
                                      eps=cfg.norm_eps)
        dpr = drop_path_rates(cfg.drop_path_rate, sum(cfg.depths))
        starts = [sum(cfg.depths[:i]) for i in range(len(cfg.depths))]
        self.layers = nn.Sequential(*[
            SwinStage(cfg, i, dims[max(i - 1, 0)], dims[i], dpr[starts[i]: starts[i] + d])
            for i, d in enumerate(cfg.depths)
        ])
        self.norm = nn.LayerNorm(self.num_features, eps=cfg.norm_eps)
        self.head = PoolHead(self.num_features, cfg.num_classes, cfg.drop_rate)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def set_attn_backend(self, backend: AttnBackend) -> None:
        self.cfg.attn_backend = check_backend(backend)
        for stage in self.layers:
            for blk in stage.blocks:
                blk.attn.backend = backend

    def no_weight_decay(self) -> set[str]:
        return {"relative_position_bias_table"}

    def forward_features(self, x: Tensor) -> Tensor:
        """Images (B, C_in, H, W) of any size -> final map (B, H/32, W/32, C); sizes that are not a
        multiple of the patch are zero-padded, as the official detection backbone does."""
        check_image(x, self.cfg.in_chans, None, type(self).__name__)
        p = self.cfg.patch_size
        if x.shape[-2] % p or x.shape[-1] % p:
            x = F.pad(x, (0, -x.shape[-1] % p, 0, -x.shape[-2] % p))
        x = self.layers(self.patch_embed(x))
        return self.norm(x)

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        return self.head(x, pre_logits=pre_logits)

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))

    @torch.no_grad()
    def attention_maps(self, x: Tensor, stage: int = 0, block: int = 0) -> tuple[Tensor, WindowPlan]:
        """Per-window attention probabilities (B·nW, heads, N, N) of one block, from the `math` path."""
        check_image(x, self.cfg.in_chans, None, type(self).__name__)
        x = self.patch_embed(x)
        for i, st in enumerate(self.layers):
            x = st.downsample(x)
            _, H, W, _ = x.shape
            for j, blk in enumerate(st.blocks):
                plan = WindowPlan.make(H, W, st.window, shifted=j % 2 == 1)
                bias = blk.attn.relative_position_bias(plan.window)[None, None]
                windows = plan.partition(x)
                if (i, j) == (stage, block):
                    _, attn = blk.attn(blk.norm1(windows), bias=bias, attn_mask=plan.mask(x.device),
                                       return_attn=True)
                    return attn, plan
                x = plan.reverse(blk(windows, bias=bias, attn_mask=plan.mask(x.device)))
        raise IndexError(f"no block {block} in stage {stage}")


def _row(embed_dim: int, depths: tuple[int, ...], heads: tuple[int, ...], window: int, img: int) -> dict:
    return dict(embed_dim=embed_dim, depths=depths, num_heads=heads, window_size=window, img_size=img,
                crop_pct=0.9 if img == 224 else 1.0, **IMAGENET)


# Keyed by timm's names.
SWIN_PRESETS: dict[str, dict] = {
    "swin_tiny_patch4_window7_224": _row(96, (2, 2, 6, 2), (3, 6, 12, 24), 7, 224),
    "swin_small_patch4_window7_224": _row(96, (2, 2, 18, 2), (3, 6, 12, 24), 7, 224),
    "swin_base_patch4_window7_224": _row(128, (2, 2, 18, 2), (4, 8, 16, 32), 7, 224),
    "swin_base_patch4_window12_384": _row(128, (2, 2, 18, 2), (4, 8, 16, 32), 12, 384),
    "swin_large_patch4_window7_224": _row(192, (2, 2, 18, 2), (6, 12, 24, 48), 7, 224),
    "swin_large_patch4_window12_384": _row(192, (2, 2, 18, 2), (6, 12, 24, 48), 12, 384),
}
