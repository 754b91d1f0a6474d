"""Vision Transformer (Dosovitskiy et al., 2021) and DeiT (Touvron et al., 2021), timm-compatible.

Parameter names and shapes follow timm's ``VisionTransformer``, so a timm state_dict of the same preset
loads with ``strict=True`` and no conversion.
"""

from collections.abc import Sequence
from functools import partial

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from vitkit.errors import UsageError

from ..layers import Attention, AttnBackend, Block, Mlp, PatchEmbed, ResPostNormBlock, drop_path_rates, sincos_2d
from ..layers.attention import check_backend
from ..layers.attention_pool import AttentionPool
from ..layers.mlp import ACTIVATIONS, SwiGLU
from ..layers.pos_embed import (
    RopeMixed,
    keep_tokens,
    resample_abs_pos_embed,
    resize_pos_grid,
    rope_tables,
)
from ..layers.token_merging import TokenMerging, merge_schedule
from .config import FollowsConfig, check_image, check_multiple, pair
from .features import new_head, resize_patch_conv, take_indices
from .packing import PackedBatch, embed_packed, pool_packed
from .vit_config import POOLS, ViTConfig, check_token_merging

# torch.fx keeps the input check as one call in a traced graph (it branches on the input's shape and values), so
# a traced model, and torchvision's and timm's feature extractors built from it, check their input too
torch.fx.wrap("check_image")

torch.fx.wrap("check_multiple")


def grid_positions(pos: Tensor, grid: tuple[int, int], trained: tuple[int, int], lead: int, interpolation: str,
                   keep_aspect: bool, antialias: bool = True) -> Tensor:
    """Learned positions (1, lead + h·w, C) of grid ``trained`` resampled to ``grid``; with ``keep_aspect`` to the
    square of its longer side, then cropped to it. One call in a traced graph (its sizes are the input's)."""
    if not torch.jit.is_scripting():  # under torch.export the sizes may stay symbolic: no branch on them
        side = torch.sym_max(grid[0], grid[1])
        to, crop = ((side, side), grid) if keep_aspect else (grid, None)
        return resample_abs_pos_embed(pos, to, trained, lead, interpolation, antialias=antialias, crop=crop)
    side = max(grid[0], grid[1])
    to, crop = ((side, side), grid) if keep_aspect else (grid, None)
    if to[0] == trained[0] and to[1] == trained[1] and crop is None:
        return pos
    return resize_pos_grid(pos, to, trained, lead, interpolation, antialias, crop)  # (the same at the trained size)


torch.fx.wrap("grid_positions")


def _positions_again(model: "VisionTransformer", incompatible_keys) -> None:  # sin-cos, after a load
    model.pos_embed = model.fixed_positions().to(model.pos_embed)


class VisionTransformer(FollowsConfig, nn.Module):
    """ViT / DeiT image classifier on the shared attention core."""

    __jit_unused_properties__ = ["num_classes"]  # TorchScript: read from the config, which it does not compile

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        C = cfg.embed_dim
        self.num_prefix_tokens = int(cfg.class_token) + int(cfg.distilled) + cfg.reg_tokens
        self.num_features = self.head_hidden_size = C  # tokens' width, and the width the head reads (timm's)
        self.patch_embed = PatchEmbed(cfg.patch_size, cfg.in_chans, C, bias=not cfg.pre_norm)  # timm's, CLIP's
        self.cls_token = nn.Parameter(torch.zeros(1, 1, C)) if cfg.class_token else None
        self.dist_token = nn.Parameter(torch.zeros(1, 1, C)) if cfg.distilled else None
        self.reg_token = nn.Parameter(torch.zeros(1, cfg.reg_tokens, C)) if cfg.reg_tokens else None
        embed_len = cfg.pos_grid_size[0] * cfg.pos_grid_size[1] + (0 if cfg.no_embed_class else self.num_prefix_tokens)
        if cfg.pos_embed == "none":
            self.pos_embed = None
        elif cfg.pos_embed == "learn":
            self.pos_embed = nn.Parameter(torch.zeros(1, embed_len, C))
        else:  # fixed: a buffer, so timm-shaped checkpoints load strictly; computed again where weights load
            self.register_buffer("pos_embed", self.fixed_positions(), persistent=False)  # (built on meta, say)
            self.register_load_state_dict_post_hook(_positions_again)
        self.pos_drop = nn.Dropout(cfg.pos_drop_rate)
        self.rope = RopeMixed(cfg.depth, cfg.num_heads, C // cfg.num_heads, cfg.rope_temperature) \
            if cfg.rope == "mixed" else None  # learned frequencies; the other RoPEs are functions of the grid
        self.norm_pre = nn.LayerNorm(C, eps=cfg.norm_eps) if cfg.pre_norm else nn.Identity()
        norm = partial(nn.LayerNorm, eps=cfg.norm_eps)
        block = ResPostNormBlock if cfg.res_post_norm else Block
        self.blocks = nn.Sequential(*[
            block(C,
                  Attention(C, cfg.num_heads, num_kv_heads=cfg.num_kv_heads, qkv_bias=cfg.qkv_bias,
                            attn_drop=cfg.attn_drop_rate, proj_drop=cfg.proj_drop_rate, backend=cfg.attn_backend,
                            norm_layer=norm if cfg.attn_norm else None),
                  self._mlp(cfg), norm_layer=norm, init_values=cfg.init_values, drop_path=dp)
            for dp in drop_path_rates(cfg.drop_path_rate, cfg.depth)
        ])
        use_fc_norm = cfg.global_pool == "avg" if cfg.fc_norm is None else cfg.fc_norm
        self.norm = nn.Identity() if use_fc_norm else nn.LayerNorm(C, eps=cfg.norm_eps)
        self.attn_pool = AttentionPool(C, cfg.num_heads, mlp_ratio=cfg.mlp_ratio, act=ACTIVATIONS[cfg.act_layer],
                                       norm_eps=cfg.norm_eps, backend=cfg.attn_backend) \
            if cfg.global_pool == "map" else None
        self.fc_norm = nn.LayerNorm(C, eps=cfg.norm_eps) if use_fc_norm else nn.Identity()
        self.head_drop = nn.Dropout(cfg.drop_rate)
        self.head = nn.Linear(C, cfg.num_classes) if cfg.num_classes > 0 else nn.Identity()
        # DeiT (Touvron et al., 2021): the distillation token's head; the two heads' logits are averaged, except
        # in training with distilled_training set, where forward returns both (for a loss against a teacher)
        self.head_dist = (nn.Linear(C, cfg.num_classes) if cfg.num_classes > 0 else nn.Identity()) \
            if cfg.distilled else None
        self.distilled_training = False
        self.grad_checkpointing = False
        self.hold_config(cfg)
        self.feature_info = [dict(num_chs=C, reduction=cfg.patch_size, module=f"blocks.{i}") for i in range(cfg.depth)]
        self.output_fmts = ("NCHW", "NLC")  # what forward_intermediates returns, the default first
        self.reset_parameters()

    def fixed_positions(self) -> Tensor:
        """(1, N, C): 2-D sin-cos positions of the configured grid, after zeros for prefix tokens given any."""
        pe = sincos_2d(self.cfg.grid_size, self.cfg.embed_dim).to(self.patch_embed.proj.weight.device)
        prefix = pe.new_zeros(0 if self.cfg.no_embed_class else self.num_prefix_tokens, pe.shape[-1])
        return torch.cat([prefix, pe])[None]

    @staticmethod
    def _mlp(cfg: ViTConfig) -> nn.Module:
        hidden = int(cfg.embed_dim * cfg.mlp_ratio)
        if cfg.mlp_layer == "swiglu":
            return SwiGLU(cfg.embed_dim, hidden, drop=cfg.proj_drop_rate, norm=cfg.mlp_norm, eps=cfg.norm_eps)
        return Mlp(cfg.embed_dim, hidden, drop=cfg.proj_drop_rate, act=ACTIVATIONS[cfg.act_layer])

    def reset_parameters(self) -> None:
        """timm's default ViT init: truncated normal(0.02) for linears and positions, tiny tokens."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        if isinstance(self.pos_embed, nn.Parameter):
            nn.init.trunc_normal_(self.pos_embed, std=0.02)
        for tok in (self.cls_token, self.reg_token):
            if tok is not None:
                nn.init.normal_(tok, std=1e-6)
        if self.dist_token is not None:
            nn.init.trunc_normal_(self.dist_token, std=0.02)  # as DeiT and timm

    def read_config(self) -> None:
        """Copy the config fields that forward reads to plain attributes (timm's names), which TorchScript
        compiles; the config calls this whenever one of its fields is set."""
        cfg = self.cfg
        self.global_pool, self.dynamic_img_size, self.no_embed_class = (cfg.global_pool, cfg.dynamic_img_size,
                                                                        cfg.no_embed_class)
        self.img_size, self.patch_size, self.in_chans = pair(cfg.img_size), cfg.patch_size, cfg.in_chans
        self.pos_grid, self.pos_interp, self.pos_keep_aspect = cfg.pos_grid_size, cfg.pos_interp, cfg.pos_keep_aspect
        self.pos_antialias = cfg.pos_antialias
        self.map_prefix = cfg.map_prefix
        self.rope_kind, self.rope_temperature, self.rope_xy, self.rope_ref_grid = (cfg.rope, cfg.rope_temperature,
                                                                                  cfg.rope_xy, cfg.rope_ref_grid)
        self.head_dim = cfg.embed_dim // cfg.num_heads
        self.merge_r = merge_schedule(cfg.token_merging, cfg.depth)  # token pairs merged in each block
        self.merging = max(self.merge_r + [0]) > 0
        for attn in [blk.attn for blk in self.blocks] + ([self.attn_pool] if self.attn_pool is not None else []):
            attn.backend = check_backend(cfg.attn_backend)

    def set_dynamic_img_size(self, enable: bool = True) -> None:
        """Take any H, W (multiples of the patch size): positions are resampled to each input's grid."""
        self.configure(dynamic_img_size=enable)

    def set_token_merging(self, r: TokenMerging = 0) -> None:
        """Merge tokens in every block from now on (ToMe, ``layers/token_merging.py``): ``r`` pairs per block, an
        ``(r, inflection)`` schedule or a per-block list; 0 turns it off. The weights stay as they are."""
        check_token_merging(r, self.cfg.depth, self.cfg.rope)
        self.configure(token_merging=r)

    def set_attn_backend(self, backend: AttnBackend) -> None:
        """Switch every attention module to another backend (weights are shared by all three)."""
        self.configure(attn_backend=backend)

    def no_weight_decay(self) -> set[str]:
        learned_rope = {"rope.freqs"} if self.rope is not None else set()  # as timm
        return {"pos_embed", "cls_token", "dist_token", "reg_token"} | learned_rope

    def _pos_embed(self, x: Tensor, grid: tuple[int, int], resample: bool = False) -> Tensor:
        B = x.shape[0]
        prefix: list[Tensor] = []
        if self.cls_token is not None:
            prefix.append(self.cls_token.expand(B, -1, -1))
        if self.dist_token is not None:
            prefix.append(self.dist_token.expand(B, -1, -1))
        if self.reg_token is not None:
            prefix.append(self.reg_token.expand(B, -1, -1))
        pos = self.pos_embed
        if pos is None:  # RoPE alone
            return self.pos_drop(torch.cat(prefix + [x], dim=1))
        if self.dynamic_img_size or resample:  # timm's dynamic_img_size: bicubic (antialiased) to this input's grid
            pos = self.positions_for(grid)
        if self.no_embed_class:  # positions cover patches only: add, then prepend
            x = torch.cat(prefix + [x + pos], dim=1)
        else:  # positions cover the prefix too: prepend, then add
            x = torch.cat(prefix + [x], dim=1) + pos
        return self.pos_drop(x)

    def positions_for(self, grid: tuple[int, int]) -> Tensor:
        """The learned positions (1, [prefix +] h·w, C) resampled to patch grid ``grid`` (``pos_interp``,
        antialiased unless ``pos_antialias`` is off; with ``pos_keep_aspect`` to the longer side's square, then cropped
        to ``grid``)."""
        assert self.pos_embed is not None
        return grid_positions(self.pos_embed, grid, self.pos_grid, 0 if self.no_embed_class else self.num_prefix_tokens,
                              self.pos_interp, self.pos_keep_aspect, self.pos_antialias)

    def embed_patches(self, x: Tensor) -> tuple[Tensor, tuple[int, int]]:
        """Images (B, C_in, H, W), checked -> patch tokens (B, N, C) before positions, and the patch grid."""
        p = self.patch_size
        check_image(x, self.in_chans, None if self.dynamic_img_size else self.img_size, "VisionTransformer")
        if self.dynamic_img_size:
            check_multiple(x, p)
        return self.patch_embed(x), (x.shape[-2] // p, x.shape[-1] // p)

    def embed_tokens(self, patches: Tensor, grid: tuple[int, int], keep: Tensor | None = None,
                     resample: bool = False) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
        """Patch tokens (B, N, C) -> the blocks' input (B, prefix + N, C) and its RoPE tables (or None): the prefix
        tokens and positions added (``resample``: the learned positions resampled to ``grid`` as with
        dynamic_img_size), then with ``keep`` ((B, K) patch indices) only those patches, in that order, with their
        RoPE rows (MAE's encoder; timm's patch_drop sits here), then ``norm_pre``."""
        rope = rope_tables(self.rope_kind, grid, self.head_dim, self.rope_temperature, self.num_prefix_tokens,
                           patches.device, self.rope_xy, self.rope_ref_grid,
                           self.rope.freqs if self.rope is not None else None)
        x = self._pos_embed(patches, grid, resample)
        if keep is not None:
            x, rope = keep_tokens(x, rope, keep, self.num_prefix_tokens)
        return self.norm_pre(x), rope  # (B, prefix + N, C), or prefix + K

    def _embed(self, x: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
        patches, grid = self.embed_patches(x)
        return self.embed_tokens(patches, grid)

    def _layer_rope(self, rope: tuple[Tensor, Tensor] | None, i: int) -> tuple[Tensor, Tensor] | None:
        """Block i's RoPE tables: the shared ones, or with learned per-block frequencies its own."""
        if rope is None or self.rope is None:
            return rope
        return rope[0][i], rope[1][i]

    def _run_block(self, i: int, blk: nn.Module, x: Tensor, rope: tuple[Tensor, Tensor] | None,
                   size: Tensor | None, where: Tensor | None) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Block i: plain with its RoPE tables, or merging tokens (then with the tokens' sizes and ``where``);
        with gradient checkpointing its activations are recomputed in backward."""
        if self.merging:
            fn, args = blk.forward_merging, (x, size, self.merge_r[i], self.num_prefix_tokens, where)
        else:
            fn, args = blk, (x, None, None, None, False, self._layer_rope(rope, i))
        out = checkpoint(fn, *args, use_reentrant=False) if self.grad_checkpointing and torch.is_grad_enabled() \
            else fn(*args)
        return out if self.merging else (out, size, where)

    def forward_features(self, x: Tensor) -> Tensor:
        """Images (B, C_in, H, W) -> normed tokens (B, prefix + N, C); with token merging fewer than N patch
        tokens, in the order ``bipartite_merge`` leaves them."""
        x, rope = self._embed(x)
        return self.forward_blocks(x, rope)

    def forward_blocks(self, x: Tensor, rope: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """The blocks' input (``embed_tokens``) -> normed tokens."""
        size: Tensor | None = None
        for i, blk in enumerate(self.blocks):
            if not torch.jit.is_scripting():
                x, size, _ = self._run_block(i, blk, x, rope, size, None)
            elif self.merging:  # TorchScript runs no checkpoint (and compiles no callable argument)
                x, size, _ = blk.forward_merging(x, size, self.merge_r[i], self.num_prefix_tokens, None)
            else:
                x = blk(x, rope=self._layer_rope(rope, i))
        return self.norm(x)

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        if self.head_dist is not None:
            return self._distilled_head(x, pre_logits)
        pool, patches = self.global_pool, x[:, self.num_prefix_tokens:]
        if self.attn_pool is not None:  # every token, the prefix too (timm's ViT), or the patches alone
            x = self.attn_pool(x if self.map_prefix else patches)
        elif pool == "token":
            x = x[:, 0]
        elif pool == "avg":
            x = patches.mean(dim=1)
        elif pool == "max":
            x = patches.amax(dim=1)
        elif pool == "avgmax":
            x = 0.5 * (patches.mean(dim=1) + patches.amax(dim=1))
        x = self.head_drop(self.fc_norm(x))
        return x if pre_logits else self.head(x)

    def _distilled_head(self, x: Tensor, pre_logits: bool) -> Tensor:
        """DeiT's two heads, on the class and the distillation token; their mean (timm's, no head dropout)."""
        assert self.head_dist is not None
        x, x_dist = x[:, 0], x[:, 1]
        if pre_logits:
            return (x + x_dist) / 2
        x, x_dist = self.head(x), self.head_dist(x_dist)
        if not torch.jit.is_scripting():
            if self.distilled_training and self.training:  # both, for a loss against a teacher
                return x, x_dist
        return (x + x_dist) / 2

    def set_distilled_training(self, enable: bool = True) -> None:
        """In training, return (class-head logits, distillation-head logits) instead of their mean (DeiT)."""
        self.distilled_training = enable

    # -- timm's model interface: fine-tuning and backbones --------------------------------------------

    @property
    def num_classes(self) -> int:
        return self.cfg.num_classes

    def get_classifier(self) -> nn.Module | tuple[nn.Module, nn.Module]:
        return self.head if self.head_dist is None else (self.head, self.head_dist)  # timm's, both for DeiT

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """A new, freshly initialised head for ``num_classes`` (0: none, forward returns pooled features)."""
        if global_pool is not None:
            if global_pool not in POOLS or (global_pool == "token" and self.cls_token is None):
                raise UsageError(f"global_pool must be one of {POOLS} ('token' needs the class token), "
                                 f"got {global_pool!r}")
            if global_pool == "map" and self.attn_pool is None:
                raise UsageError("global_pool='map' needs an attention pool, which only a model built with "
                                 "global_pool='map' has (its weights come with the checkpoint)")
            if global_pool != "map":
                self.attn_pool = None  # as timm: another pooling drops the attention pool
            # the norms stay where they are
            self.configure(fc_norm=not isinstance(self.fc_norm, nn.Identity), global_pool=global_pool)
        self.configure(num_classes=num_classes)
        self.head = new_head(self.num_features, num_classes, self.patch_embed.proj.weight)
        if self.head_dist is not None:
            self.head_dist = new_head(self.num_features, num_classes, self.patch_embed.proj.weight)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each block's activations in the backward pass instead of keeping them (less memory)."""
        self.grad_checkpointing = enable

    def group_matcher(self, coarse: bool = False) -> dict:
        """Parameter groups by depth (timm's), for layer-wise LR decay: the stem, each block, the final norm."""
        stem = r"^cls_token|pos_embed|patch_embed|dist_token" if self.cfg.distilled else \
            r"^cls_token|reg_token|pos_embed|patch_embed|norm_pre"  # timm's regexes for DeiT distilled and ViT
        return dict(stem=stem, blocks=[(r"^blocks\.(\d+)", None), (r"^norm", (99999,))])

    def forward_intermediates(self, x: Tensor, indices: int | Sequence[int] | None = None,
                              return_prefix_tokens: bool = False, norm: bool = False, stop_early: bool = False,
                              output_fmt: str = "NCHW", intermediates_only: bool = False):
        """(final normed tokens, [block outputs]) or, with ``intermediates_only``, the list alone.

        ``indices``: the last n blocks for an int, the listed ones for a sequence, all for None. Outputs
        are maps (B, C, h, w) for ``NCHW`` or patch tokens (B, N, C) for ``NLC``; ``return_prefix_tokens``
        pairs each with its class/register tokens (B, prefix, C); ``norm`` applies the final norm to each.

        With token merging, ``NLC`` gives each block's merged patch tokens (fewer block by block, in the order
        ``bipartite_merge`` leaves them), and ``NCHW`` the full (B, C, h, w) grid in which every patch shows the
        merged token it is part of (a token that holds k patches appears at all k)."""
        if output_fmt not in self.output_fmts:
            raise UsageError(f"output_fmt must be one of {self.output_fmts}, got {output_fmt!r}")
        taken, last = take_indices(len(self.blocks), indices)
        B, _, H, W = x.shape
        x, rope = self._embed(x)
        out, wheres = [], []
        size, where = None, torch.arange(x.shape[1], device=x.device).expand(B, -1) if self.merging else None
        for i, blk in enumerate(self.blocks[: last + 1] if stop_early else self.blocks):
            x, size, where = self._run_block(i, blk, x, rope, size, where)
            if i in taken:
                out.append(self.norm(x) if norm else x)
                wheres.append(where)
        p = self.num_prefix_tokens
        prefix, out = [y[:, :p] for y in out], [y[:, p:] for y in out]
        if output_fmt == "NCHW":
            if self.merging:  # each patch takes the token it was merged into
                out = [torch.cat([y_p, y], 1).gather(1, w[:, p:, None].expand(-1, -1, y.shape[-1]))
                       for y_p, y, w in zip(prefix, out, wheres, strict=True)]
            gh, gw = H // self.cfg.patch_size, W // self.cfg.patch_size
            out = [y.reshape(B, gh, gw, -1).permute(0, 3, 1, 2).contiguous() for y in out]  # (B, C, h, w)
        if return_prefix_tokens and p:
            out = list(zip(out, prefix, strict=True))
        return out if intermediates_only else (self.norm(x), out)

    def prune_intermediate_layers(self, indices: int | Sequence[int] = 1, prune_norm: bool = False,
                                  prune_head: bool = True) -> list[int]:
        """Drop the blocks after the last of ``indices`` (and the final norm / head); returns the indices."""
        taken, last = take_indices(len(self.blocks), indices)
        self.blocks = self.blocks[: last + 1]
        self.configure(depth=last + 1)
        self.feature_info = self.feature_info[: last + 1]
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self.fc_norm = nn.Identity()
            self.reset_classifier(0, "")
        return taken

    @torch.no_grad()
    def set_input_size(self, img_size: int | tuple[int, int] | None = None, patch_size: int | None = None) -> None:
        """Take another input resolution and/or patch size: the learned positions are resampled (bicubic)
        to the new patch grid and the patch kernel is pseudo-inverse resized, as timm does."""
        old_grid = self.cfg.pos_grid_size
        if patch_size is not None and patch_size != self.cfg.patch_size:
            resize_patch_conv(self.patch_embed, patch_size)
            self.configure(patch_size=patch_size)
            for info in self.feature_info:
                info["reduction"] = patch_size
        if img_size is not None:
            self.configure(img_size=img_size)
        grid = self.cfg.pos_grid_size  # with pos_grid the positions stay as they are (resampled per input)
        if grid == old_grid:
            return
        prefix = 0 if self.cfg.no_embed_class else self.num_prefix_tokens
        if isinstance(self.pos_embed, nn.Parameter):
            self.pos_embed = nn.Parameter(resample_abs_pos_embed(self.pos_embed, grid, old_grid, prefix),
                                          requires_grad=self.pos_embed.requires_grad)
        elif self.pos_embed is not None:  # fixed sin-cos; RoPE alone needs nothing (its tables follow the input)
            self.pos_embed = self.fixed_positions().to(self.pos_embed)

    def forward_packed(self, batch: PackedBatch, pre_logits: bool = False) -> Tensor:
        """Logits (images, classes), in the order packed, of images of their own sizes packed into sequences
        (``packing.pack``): attention within each image, its positions resampled to its grid; image by image the
        logits of that image run alone through :meth:`forward` (with ``dynamic_img_size``); with ``pre_logits`` the
        pooled features the head reads."""
        x = self.head_drop(self.fc_norm(pool_packed(self, self.packed_tokens(batch), batch)))
        return x if pre_logits else self.head(x)

    def packed_tokens(self, batch: PackedBatch, mask: Tensor | None = None, mask_token: Tensor | None = None) -> Tensor:
        """A packed batch -> its normed tokens (S, L, C), slot by slot: the blocks' output before pooling (MAE's
        encoder and DINO read it); the patches of ``mask`` ((S, L) bool) replaced by ``mask_token``."""
        if self.merging:
            raise UsageError("token merging removes tokens per sequence, not per packed image: turn it off "
                             "(set_token_merging(0)) to pack")
        x, rope = embed_packed(self, batch, mask, mask_token)
        mask = batch.attn_mask()
        for i, blk in enumerate(self.blocks):
            args = (x, None, mask, None, False, self._layer_rope(rope, i))
            x = checkpoint(blk, *args, use_reentrant=False) if self.grad_checkpointing and torch.is_grad_enabled() \
                else blk(*args)
        return self.norm(x)

    def forward(self, x: Tensor) -> Tensor:
        """Images (B, C_in, H, W) -> logits (B, classes); a :class:`PackedBatch` (images of their own sizes) ->
        :meth:`forward_packed`, so that wrappers that call the model (an EMA, DDP, FSDP2) take packed batches too."""
        if not torch.jit.is_scripting():  # (TorchScript compiles only the other branch)
            if isinstance(x, PackedBatch):
                return self.forward_packed(x)
        return self.forward_head(self.forward_features(x))

    @torch.no_grad()
    def attention_maps(self, x: Tensor) -> list[Tensor]:
        """Per-layer attention probabilities (B, H, N, N), from the `math` reference path; of the unmerged model
        (token merging is not applied here)."""
        x, rope = self._embed(x)
        maps = []
        for i, blk in enumerate(self.blocks):
            r = self._layer_rope(rope, i)
            _, attn = blk.attn.forward_with_attn(blk.norm1(x), rope=r)
            maps.append(attn)
            x = blk(x, rope=r)
        return maps
