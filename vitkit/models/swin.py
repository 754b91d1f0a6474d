"""Swin Transformer (Liu et al., 2021) and Swin V2 (Liu et al., 2022) on the shared attention core, timm-compatible.

A Swin block is the pre-norm :class:`vitkit.layers.Block` run on windows (:class:`WindowBlock` only adds the
relative-position bias of its window): layer norm and MLP act per token, so cutting the map into (shifted) windows
before the block and stitching it after is the same as windowing only the attention. Windows are folded into the
attention's group axis, so the relative position bias and the shift mask broadcast over the batch inside the fused
kernel. Swin V2 is the same stack with other parts: cosine attention with a continuous position bias
(:class:`CosineWindowAttention`), residual post-norm blocks and merging that normalises after the reduction.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ..errors import UsageError
from ..layers import AttnBackend, Mlp, PatchEmbed, drop_path_rates
from ..layers.attention import check_backend
from ..layers.block import WindowBlock
from ..layers.window import WindowAttention, WindowPlan, is_symbolic, token_index
from ..layers.window_v2 import CosineWindowAttention, ResPostNormWindowBlock
from .config import DataConfig, FollowsConfig, check_image, pair
from .features import new_head, resize_patch_conv, take_indices

# torch.fx keeps the input check as one call in a traced graph (it branches on the input's shape and values), so
# a traced model, and torchvision's and timm's feature extractors built from it, check their input too
torch.fx.wrap("check_image")


def tracing(x: Tensor) -> bool:
    """Under torch.fx symbolic tracing, where sizes are not known: Swin then plans its windows for the
    configured img_size, as timm's Swin always does."""
    return isinstance(x, torch.fx.Proxy)


def pad_to_multiple(x: Tensor, H: int, W: int, p: int) -> Tensor:
    """``x`` (..., H, W) zero-padded at the bottom and right to multiples of ``p``. The padded size is written as a
    multiple, (H + p - 1) // p * p: a size traced by torch.export stays one short expression (the remainder form
    nests a Mod per stage), and no operand is negative (ONNX truncates)."""
    return F.pad(x, (0, (W + p - 1) // p * p - W, 0, (H + p - 1) // p * p - H))


POOLS = ("avg", "max", "avgmax", "")  # "": no pooling, the head sees the (B, H, W, C) map


def check_padding(cfg) -> None:
    if cfg.attend_padding and cfg.version == 2:
        raise UsageError("attend_padding is Swin V1's (pre-norm blocks); Swin V2 masks its padding")


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
    window_size: int | tuple = 7  # one for all stages, or one per stage (an int or an (h, w) pair each)
    mlp_ratio: float = 4.0
    qkv_bias: bool = True
    norm_eps: float = 1e-5
    drop_rate: float = 0.0
    proj_drop_rate: float = 0.0
    attn_drop_rate: float = 0.0
    drop_path_rate: float = 0.1
    attn_backend: AttnBackend = "auto"
    global_pool: Literal["avg", "max", "avgmax", ""] = "avg"
    crop_pct: float = 0.9
    version: Literal[1, 2] = 1  # 2: Swin V2's cosine attention, continuous position bias, post-norm blocks
    pretrained_window_sizes: tuple[int, ...] | None = None  # V2: per stage, the window its bias MLP was trained at
    # a map that is not a whole number of windows is padded; the padding is masked out of attention (False), or
    # attended as zero vectors (True: the official detection and segmentation backbone's, mmsegmentation's and
    # transformers' Swin, which their UperNet weights were trained with)
    attend_padding: bool = False
    # the configured window and shift at every map size, padded (the detection and segmentation backbones' rule:
    # mmsegmentation's, transformers' SwinBackbone); False: a larger window shrinks to the map, unshifted (timm's)
    always_partition: bool = False

    def __post_init__(self) -> None:
        check_backend(self.attn_backend)
        self.depths, self.num_heads = tuple(self.depths), tuple(self.num_heads)
        if len(self.depths) != len(self.num_heads):
            raise UsageError(f"depths {self.depths} and num_heads {self.num_heads} need one entry per stage")
        if not isinstance(self.window_size, int) and len(self.window_size) != len(self.depths):
            raise UsageError(f"window_size {self.window_size} needs one entry per stage ({len(self.depths)})")
        if self.global_pool not in POOLS:
            raise UsageError(f"global_pool must be one of {POOLS}, got {self.global_pool!r}")
        if self.version not in (1, 2):
            raise UsageError(f"version must be 1 or 2 (Swin V2), got {self.version!r}")
        check_padding(self)
        if self.pretrained_window_sizes is not None:
            self.pretrained_window_sizes = tuple(self.pretrained_window_sizes)
            if len(self.pretrained_window_sizes) != len(self.depths):
                raise UsageError(f"pretrained_window_sizes {self.pretrained_window_sizes} needs one entry per stage "
                                 f"({len(self.depths)})")

    @property
    def stage_windows(self) -> tuple[tuple[int, int], ...]:
        """The (h, w) window of each stage, before it shrinks to a smaller map."""
        ws = self.window_size
        return ((ws, ws),) * len(self.depths) if isinstance(ws, int) else tuple(pair(w) for w in ws)

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
        return self.reduction(self.norm(self.merge(x)))

    def merge(self, x: Tensor) -> Tensor:
        """(B, H, W, C) -> (B, H/2, W/2, 4C)."""
        B, H, W, C = x.shape
        if torch.jit.is_scripting():
            odd = H % 2 == 1 or W % 2 == 1
        else:  # traced (fx, export): pad always, a no-op when the sizes are even
            odd = tracing(x) or is_symbolic(H, W) or H % 2 == 1 or W % 2 == 1
        if odd:  # to even sizes, written as whole pairs (see pad_to_multiple)
            He, We = (H + 1) // 2 * 2, (W + 1) // 2 * 2
            x = F.pad(x, (0, 0, 0, We - W, 0, He - H))
            H, W = He, We
        # (B, H/2, W/2, 4C); the four neighbours in timm's order (0,0), (1,0), (0,1), (1,1)
        return x.reshape(B, H // 2, 2, W // 2, 2, C).permute(0, 1, 3, 4, 2, 5).flatten(3)


class PatchMergingV2(PatchMerging):
    """Swin V2's merging: Linear 4C -> 2C, then LayerNorm on 2C."""

    def __init__(self, dim: int, out_dim: int, eps: float) -> None:
        super().__init__(dim, out_dim, eps)
        self.norm = nn.LayerNorm(out_dim, eps=eps)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(self.reduction(self.merge(x)))


def _plan_again(stage: "SwinStage", incompatible_keys) -> None:
    stage.plan_windows()


class SwinStage(nn.Module):
    """Optional patch merging, then blocks alternating regular and shifted windows."""

    def __init__(self, cfg: SwinConfig, i: int, dim: int, out_dim: int, drop_path: list[float]) -> None:
        super().__init__()
        H, W = self.size = cfg.stage_sizes[i]  # at the configured img_size; the sizes a traced graph is built for
        w = cfg.stage_windows[i]
        self.always_partition = cfg.always_partition
        self.window = w if cfg.always_partition else (min(w[0], H), min(w[1], W))
        self.attend_padding = cfg.attend_padding
        self.grad_checkpointing = False
        v2 = cfg.version == 2
        self.downsample = (PatchMergingV2 if v2 else PatchMerging)(dim, out_dim, cfg.norm_eps) if i else nn.Identity()
        attn = dict(attn_drop=cfg.attn_drop_rate, proj_drop=cfg.proj_drop_rate, backend=cfg.attn_backend)
        if v2:  # q and v biases (keys none), the bias MLP read at offsets scaled to the pretraining window
            pretrained = cfg.pretrained_window_sizes[i] if cfg.pretrained_window_sizes else 0
            attn.update(qkv_bias="qv" if cfg.qkv_bias else False, pretrained_window=pair(pretrained) if pretrained
                        else None)
        else:
            attn.update(qkv_bias=cfg.qkv_bias)
        block, attention = (ResPostNormWindowBlock, CosineWindowAttention) if v2 else (WindowBlock, WindowAttention)
        self.blocks = nn.Sequential(*[
            block(out_dim, attention(out_dim, cfg.num_heads[i], self.window, **attn),
                  Mlp(out_dim, int(out_dim * cfg.mlp_ratio), drop=cfg.proj_drop_rate),
                  norm_layer=partial(nn.LayerNorm, eps=cfg.norm_eps), drop_path=dp)
            for dp in drop_path
        ])
        self.plan_windows()
        # the planned buffers are computed, never saved: after weights are loaded into a model built elsewhere
        # (on the meta device, then materialised) they are computed again where the weights are
        self.register_load_state_dict_post_hook(_plan_again)

    def set_window(self, window: tuple[int, int]) -> None:
        """Use another window; each block's relative-position table is resized to it."""
        for blk in self.blocks:
            blk.attn.set_table_window(window)
        self.window = tuple(window)
        self.plan_windows()

    def plan_windows(self) -> None:
        """Lay out every block's windows for the configured map size (``self.size``) once, as buffers:
        TorchScript runs these (it cannot plan at run time); eager and compiled runs plan from the input."""
        H, W = self.size
        device = self.blocks[0].attn.proj.weight.device
        prev = None
        for j, blk in enumerate(self.blocks):
            plan = WindowPlan.make(H, W, self.window, shifted=j % 2 == 1, fixed=self.always_partition)
            mask, keep = plan.mask(device, self.attend_padding), plan.keep(device) if self.attend_padding else None
            blk.attn.plan(plan.window, token_index(prev, plan, device).clone(),
                          None if mask is None else mask.clone(), plan.num_windows)
            blk.register_buffer("planned_keep", None if keep is None else keep.clone(), persistent=False)
            prev = plan
        self.register_buffer("planned_unwindow", token_index(prev, None, device).clone(), persistent=False)

    def forward_planned(self, x: Tensor) -> Tensor:
        """:meth:`forward` on the windows planned for the configured size (what TorchScript runs)."""
        B, C = x.shape[0], x.shape[-1]
        H, W = self.size
        x = x.reshape(B, H * W, C)
        for blk in self.blocks:
            x = x.index_select(1, blk.attn.planned_gather).view(B, blk.attn.planned_windows, -1, C)
            x = blk(x, None, blk.attn.planned_mask, blk.planned_keep).flatten(1, 2)  # None: the planned window
        return x.index_select(1, self.planned_unwindow).view(B, H, W, C)

    def forward(self, x: Tensor) -> Tensor:
        x = self.downsample(x)
        if torch.jit.is_scripting():
            return self.forward_planned(x)
        else:  # windows planned from the input; torch.fx traces the planned ones (the input check holds the size)
            if tracing(x):
                return self.forward_planned(x)
            B, H, W, C = x.shape
            plans = [WindowPlan.make(H, W, self.window, shifted=j % 2 == 1, fixed=self.always_partition)
                     for j in range(len(self.blocks))]
            # Tokens stay in window order from block to block: each hand-over (un-shift, re-shift, re-cut)
            # is one gather along the token axis; see WindowPlan.partition/reverse for the same in steps.
            x = x.reshape(B, H * W, C)
            prev = None
            for blk, plan in zip(self.blocks, plans, strict=True):
                x = x.index_select(1, token_index(prev, plan, x.device))  # (B, nW·N, C)
                x = x.view(B, plan.num_windows, -1, C)  # (B, nW, N, C)
                mask = plan.mask(x.device, self.attend_padding)
                keep = plan.keep(x.device) if self.attend_padding else None
                if self.grad_checkpointing and torch.is_grad_enabled():  # recompute activations in backward
                    x = checkpoint(blk, x, plan.window, mask, *([keep] if keep is not None else []),
                                   use_reentrant=False)
                elif keep is not None:
                    x = blk(x, plan.window, mask, keep)
                else:
                    x = blk(x, plan.window, mask)
                x, prev = x.flatten(1, 2), plan
            return x.index_select(1, token_index(prev, None, x.device)).view(B, H, W, C)


class PoolHead(nn.Module):
    """Global pool over the map (average by default), dropout, linear classifier (``head.fc`` as in timm)."""

    def __init__(self, dim: int, num_classes: int, drop: float, pool: str = "avg") -> None:
        super().__init__()
        self.pool = pool
        self.drop = nn.Dropout(drop)
        self.fc = nn.Linear(dim, num_classes) if num_classes > 0 else nn.Identity()

    def forward(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        if self.pool == "avg":
            x = x.mean(dim=(1, 2))  # (B, C)
        elif self.pool == "max":
            x = x.amax(dim=(1, 2))
        elif self.pool == "avgmax":
            x = 0.5 * (x.mean(dim=(1, 2)) + x.amax(dim=(1, 2)))
        x = self.drop(x)
        return x if pre_logits else self.fc(x)


class SwinTransformer(FollowsConfig, nn.Module):
    """Hierarchical vision transformer with (shifted) window attention."""

    __jit_unused_properties__ = ["num_classes"]  # TorchScript: read from the config, which it does not compile

    def __init__(self, cfg: SwinConfig) -> None:
        super().__init__()
        self.cfg = cfg
        dims = [cfg.embed_dim * 2**i for i in range(len(cfg.depths))]
        self.num_features = self.head_hidden_size = dims[-1]  # the last stage's width, which the head reads
        self.patch_embed = PatchEmbed(cfg.patch_size, cfg.in_chans, dims[0], norm=True, flatten=False,
                                      eps=cfg.norm_eps)
        dpr = drop_path_rates(cfg.drop_path_rate, sum(cfg.depths))
        starts = [sum(cfg.depths[:i]) for i in range(len(cfg.depths))]
        self.layers = nn.Sequential(*[
            SwinStage(cfg, i, dims[max(i - 1, 0)], dims[i], dpr[starts[i]: starts[i] + d])
            for i, d in enumerate(cfg.depths)
        ])
        self.norm = nn.LayerNorm(self.num_features, eps=cfg.norm_eps)
        self.head = PoolHead(self.num_features, cfg.num_classes, cfg.drop_rate, cfg.global_pool)
        self.feature_info = [dict(num_chs=d, reduction=cfg.patch_size * 2**i, module=f"layers.{i}")
                             for i, d in enumerate(dims)]
        self.output_fmts = ("NHWC", "NCHW")  # what forward_intermediates can return; NHWC for features_only
        self.output_fmt = "NHWC"  # timm's: the layout of forward_features (B, H, W, C)
        self._ref_windows, self._ref_grid = cfg.stage_windows, self._grid()  # set_input_size scales from these
        self.hold_config(cfg)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def read_config(self) -> None:
        """Copy the config fields that forward reads to plain attributes (which TorchScript compiles) and to the
        modules that read them (the pooling, the attention backend); :meth:`configure` calls it."""
        cfg = self.cfg
        self.img_size, self.patch_size, self.in_chans = pair(cfg.img_size), cfg.patch_size, cfg.in_chans
        self.head.pool = cfg.global_pool
        check_padding(cfg)  # configure() changes fields without the config's own checks
        for stage in self.layers:
            for blk in stage.blocks:
                blk.attn.backend = check_backend(cfg.attn_backend)
            if (stage.attend_padding, stage.always_partition) != (cfg.attend_padding, cfg.always_partition):
                stage.attend_padding, stage.always_partition = cfg.attend_padding, cfg.always_partition
                stage.plan_windows()  # the planned windows' mask and padding follow them

    def set_attn_backend(self, backend: AttnBackend) -> None:
        self.configure(attn_backend=backend)

    def no_weight_decay(self) -> set[str]:
        """Swin's bias tables; V2's temperatures and bias MLPs (timm's)."""
        return {"relative_position_bias_table"} | {n for n, _ in self.named_parameters()
                                                   if "cpb_mlp" in n or "logit_scale" in n}

    def embed_patches(self, x: Tensor) -> Tensor:
        """Images (B, C_in, H, W) of any size -> patch map (B, H/p, W/p, C); sizes that are not a multiple
        of the patch are zero-padded, as the official detection backbone does."""
        if torch.jit.is_scripting():
            return self._embed_configured(x)
        else:
            if tracing(x):
                return self._embed_configured(x)
            p = self.patch_size
            check_image(x, self.in_chans, None, "SwinTransformer")
            H, W = x.shape[-2:]
            if is_symbolic(H, W) or H % p or W % p:
                x = pad_to_multiple(x, H, W, p)
            return self.patch_embed(x)

    def _embed_configured(self, x: Tensor) -> Tensor:
        """TorchScript and torch.fx take the configured size only (their windows are planned for it): checked."""
        p = self.patch_size
        check_image(x, self.in_chans, self.img_size, "SwinTransformer")
        H, W = self.img_size
        return self.patch_embed(pad_to_multiple(x, H, W, p) if H % p or W % p else x)

    def forward_features(self, x: Tensor) -> Tensor:
        """Images (B, C_in, H, W) of any size -> final map (B, H/32, W/32, C)."""
        return self.norm(self.layers(self.embed_patches(x)))

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        return self.head(x, pre_logits=pre_logits)

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))

    # -- timm's model interface: fine-tuning and backbones --------------------------------------------

    @property
    def num_classes(self) -> int:
        return self.cfg.num_classes

    def get_classifier(self) -> nn.Module:
        return self.head.fc

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """A new, freshly initialised head for ``num_classes`` (0: none, forward returns pooled features)."""
        if global_pool is not None:
            if global_pool not in POOLS:
                raise UsageError(f"global_pool must be one of {POOLS}, got {global_pool!r}")
            self.configure(global_pool=global_pool)
        self.configure(num_classes=num_classes)
        self.head.fc = new_head(self.num_features, num_classes, self.patch_embed.proj.weight)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each block's activations in the backward pass instead of keeping them (less memory)."""
        for stage in self.layers:
            stage.grad_checkpointing = enable

    def group_matcher(self, coarse: bool = False) -> dict:
        """Parameter groups by depth (timm's), for layer-wise LR decay: the stem, each block (patch merging
        with the first block of its stage), the final norm; ``coarse``: one group per stage."""
        stem = r"^absolute_pos_embed|patch_embed" if self.cfg.version == 2 else r"^patch_embed"  # timm's regexes
        return dict(stem=stem, blocks=r"^layers\.(\d+)" if coarse else [
            (r"^layers\.(\d+).downsample", (0,)), (r"^layers\.(\d+)\.\w+\.(\d+)", None), (r"^norm", (99999,))])

    def forward_intermediates(self, x: Tensor, indices: int | Sequence[int] | None = None, norm: bool = False,
                              stop_early: bool = False, output_fmt: str = "NCHW", intermediates_only: bool = False):
        """(final normed map (B, h, w, C), [stage outputs]) or, with ``intermediates_only``, the list alone.

        ``indices``: the last n stages for an int, the listed ones for a sequence, all for None. Stage
        outputs are (B, C, h, w) for ``NCHW`` and (B, h, w, C) for ``NHWC``; ``norm`` applies the final
        norm to the last stage's (the only one it is sized for)."""
        if output_fmt not in self.output_fmts:
            raise UsageError(f"output_fmt must be one of {self.output_fmts}, got {output_fmt!r}")
        taken, last = take_indices(len(self.layers), indices)
        x = self.embed_patches(x)
        out, final = [], len(self.layers) - 1
        for i, stage in enumerate(self.layers[: last + 1] if stop_early else self.layers):
            x = stage(x)  # (B, h, w, C)
            if i in taken:
                y = self.norm(x) if norm and i == final else x
                out.append(y.permute(0, 3, 1, 2).contiguous() if output_fmt == "NCHW" else y)
        if intermediates_only:
            return out
        return (self.norm(x) if i == final else x), out

    def prune_intermediate_layers(self, indices: int | Sequence[int] = 1, prune_norm: bool = False,
                                  prune_head: bool = True) -> list[int]:
        """Drop the stages after the last of ``indices`` (and the final norm / head); returns the indices."""
        taken, last = take_indices(len(self.layers), indices)
        cut = last < len(self.layers) - 1
        if prune_norm or cut:
            self.norm = nn.Identity()  # sized for the last stage only
        self.layers = self.layers[: last + 1]
        cfg = self.cfg
        windows = cfg.window_size if isinstance(cfg.window_size, int) else tuple(cfg.window_size[: last + 1])
        self.configure(depths=cfg.depths[: last + 1], num_heads=cfg.num_heads[: last + 1], window_size=windows)
        self._ref_windows, self.feature_info = self._ref_windows[: last + 1], self.feature_info[: last + 1]
        if cut:
            self.num_features = self.head_hidden_size = self.feature_info[last]["num_chs"]
        if prune_head or cut:
            self.reset_classifier(0, "")
        return taken

    def _grid(self) -> tuple[int, int]:
        return tuple(s // self.cfg.patch_size for s in pair(self.cfg.img_size))

    @torch.no_grad()
    def set_input_size(self, img_size: int | tuple[int, int] | None = None, patch_size: int | None = None,
                       window_size: int | Sequence | None = None, window_ratio: int | Sequence[int] | None = None,
                       ) -> None:
        """Plan the windows for another input size, as timm does: each stage's window scales with the patch
        grid (224 -> 384 takes window 7 to 12), unless ``window_size`` (an int or (h, w) for all stages, or
        one per stage) or ``window_ratio`` (grid // ratio) sets it. Relative-position tables are resized."""
        n = len(self.layers)  # the window arguments are checked before anything changes
        chosen = _per_stage(window_size, n) if window_size is not None else None
        ratios = None
        if chosen is None and window_ratio is not None:
            ratios = (window_ratio,) * n if isinstance(window_ratio, int) else tuple(window_ratio)
            if len(ratios) != n:
                raise UsageError(f"window_ratio {window_ratio} needs one entry per stage ({n})")
        if patch_size is not None and patch_size != self.cfg.patch_size:
            resize_patch_conv(self.patch_embed, patch_size)
            self.configure(patch_size=patch_size)
            for i, info in enumerate(self.feature_info):
                info["reduction"] = patch_size * 2**i
        if img_size is not None:
            self.configure(img_size=img_size)
        grid = self._grid()
        if ratios is not None:
            chosen = tuple((max(1, grid[0] // r), max(1, grid[1] // r)) for r in ratios)
        if chosen is not None:  # set explicitly: the new reference for later resizes
            windows, self._ref_windows, self._ref_grid = chosen, chosen, grid
        else:  # scaled with the grid from the reference
            ref = self._ref_grid
            windows = tuple((max(1, w[0] * grid[0] // ref[0]), max(1, w[1] * grid[1] // ref[1]))
                            for w in self._ref_windows)
        self.configure(window_size=tuple(w[0] if w[0] == w[1] else w for w in windows))
        for stage, (H, W), w in zip(self.layers, self.cfg.stage_sizes, windows, strict=True):
            stage.size = (H, W)
            stage.set_window(w if stage.always_partition else (min(w[0], H), min(w[1], W)))

    @torch.no_grad()
    def attention_maps(self, x: Tensor, stage: int = 0, block: int = 0) -> tuple[Tensor, WindowPlan]:
        """Per-window attention probabilities (B·nW, heads, N, N) of one block, from the `math` path."""
        check_image(x, self.cfg.in_chans, None, type(self).__name__)
        x = self.patch_embed(x)
        for i, st in enumerate(self.layers):
            x = st.downsample(x)
            _, H, W, _ = x.shape
            for j, blk in enumerate(st.blocks):
                plan = WindowPlan.make(H, W, st.window, shifted=j % 2 == 1, fixed=st.always_partition)
                windows = plan.partition(x)
                if (i, j) == (stage, block):
                    bias = blk.attn.relative_position_bias(plan.window)[None, None]  # (1, 1, H, N, N)
                    _, attn = blk.attn.forward_with_attn(blk.norm1(windows), bias, plan.mask(x.device))
                    return attn, plan
                x = plan.reverse(blk(windows, plan.window, plan.mask(x.device)))
        raise IndexError(f"no block {block} in stage {stage}")


def _per_stage(window: int | Sequence, n: int) -> tuple[tuple[int, int], ...]:
    """An int or (h, w) for every stage, or one entry per stage -> n (h, w) pairs."""
    if isinstance(window, int):
        return ((window, window),) * n
    window = tuple(window)
    if len(window) == 2 and n != 2 and all(isinstance(w, int) for w in window):
        return (window,) * n
    if len(window) != n:
        raise UsageError(f"window_size {window}: expected an int, an (h, w) pair or one entry per stage ({n})")
    return tuple(pair(w) for w in window)
