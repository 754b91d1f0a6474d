"""Masked image modeling on an unmodified encoder: MAE (He et al., 2022) for ViT, SimMIM (Xie et al., 2022) for
Swin and ViT. Pre-train on unlabeled images; the encoder is then the ViT / Swin of its preset, with the preset's
parameter names, and fine-tunes as any backbone does.

MAE hides most patches and encodes only the visible ones (with the prefix tokens: class, registers), through the
ViT's own steps (``embed_patches`` -> ``embed_tokens(keep=...)`` -> ``forward_blocks``); a light decoder of the same
``Block`` sees every position (the encoded tokens and a learned mask token) and predicts each masked patch's pixels.
Parameter names follow Meta's reference code (``decoder_embed``, ``mask_token``, ``decoder_pos_embed``,
``decoder_blocks``, ``decoder_norm``, ``decoder_pred``), so its files load as they are.

SimMIM keeps every patch (Swin's windows need the whole grid) and replaces the masked ones at the input with a
learned mask token, in blocks of ``mask_patch_size`` pixels; a 1x1 convolution and a pixel shuffle predict raw
pixels from the final map, and the loss is L1 on the masked pixels.

Shape legend: B batch; N patches (h x w grid); K kept patches; P prefix tokens; C encoder width; Cd decoder width;
p patch size; c image channels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vitkit.errors import UsageError

from ..layers import Attention, AttnBackend, Block, Mlp, sincos_2d
from .config import check_image, pair
from .encoders import vision_encoder
from .packing import PackedBatch, grid_rows, pack
from .swin import SwinTransformer
from .vit import VisionTransformer


@dataclass
class MAEConfig:
    """An MAE: the encoder preset it pre-trains, the masking, and its decoder (the paper's 512 wide, 8 blocks,
    16 heads by default)."""

    encoder: str = "vit_base_patch16_224"
    encoder_overrides: dict[str, Any] = field(default_factory=dict)
    mask_ratio: float = 0.75
    decoder_embed_dim: int = 512
    decoder_depth: int = 8
    decoder_num_heads: int = 16
    decoder_mlp_ratio: float = 4.0
    norm_pix_loss: bool = True  # per-patch normalised targets, the paper's best setting
    norm_eps: float = 1e-6  # the decoder's LayerNorms
    attn_backend: AttnBackend = "auto"

    def __post_init__(self) -> None:
        check_ratio(self.mask_ratio)
        if self.decoder_embed_dim % self.decoder_num_heads:
            raise UsageError(f"decoder_embed_dim {self.decoder_embed_dim} must be divisible by decoder_num_heads "
                             f"{self.decoder_num_heads}")
        if self.decoder_depth < 1:
            raise UsageError(f"decoder_depth must be >= 1, got {self.decoder_depth}")


@dataclass
class SimMIMConfig:
    """A SimMIM: the encoder preset it pre-trains (Swin or ViT), and the masking (the paper's 0.6 of the image in
    blocks of 32 x 32 pixels)."""

    encoder: str = "swin_base_patch4_window7_224"
    encoder_overrides: dict[str, Any] = field(default_factory=dict)
    mask_ratio: float = 0.6
    mask_patch_size: int = 32

    def __post_init__(self) -> None:
        check_ratio(self.mask_ratio)
        if self.mask_patch_size < 1:
            raise UsageError(f"mask_patch_size must be >= 1, got {self.mask_patch_size}")


def check_ratio(ratio: float) -> None:
    if not 0 < ratio < 1:
        raise UsageError(f"mask_ratio must be in (0, 1): a fraction of the patches to hide, got {ratio}")


@dataclass
class MIMOutput:
    """What a masked-image model returns: the loss, its prediction and the mask (1 or True: hidden)."""

    loss: Tensor
    pred: Tensor  # MAE: (B, N, p·p·c) per patch, in the loss's units; SimMIM: (B, c, H, W)
    mask: Tensor  # (B, N), at the encoder's patch grid


def patchify(images: Tensor, p: int) -> Tensor:
    """(B, c, H, W) -> (B, N, p·p·c), each patch's pixels in (row, column, channel) order, as MAE's code."""
    B, c, H, W = images.shape
    x = images.reshape(B, c, H // p, p, W // p, p)
    return torch.einsum("bchpwq->bhwpqc", x).reshape(B, (H // p) * (W // p), p * p * c)


def unpatchify(patches: Tensor, p: int, grid: tuple[int, int]) -> Tensor:
    """(B, N, p·p·c) -> (B, c, h·p, w·p)."""
    B, _, D = patches.shape
    h, w = grid
    x = patches.reshape(B, h, w, p, p, D // (p * p))
    return torch.einsum("bhwpqc->bchpwq", x).reshape(B, D // (p * p), h * p, w * p)


def check_divides(images: Tensor, block: int, what: str) -> None:
    """An image must hold a whole number of patches (MAE) or mask blocks (SimMIM), and at least one."""
    H, W = images.shape[-2:]
    if H < block or W < block or H % block or W % block:
        raise UsageError(f"masked image modeling takes images whose sides are multiples of the {what} ({block} px), "
                         f"at least one; got {H}x{W}")


class MaskedAutoencoder(nn.Module):
    """MAE (He et al., 2022): the ViT encodes the visible patches; a light decoder predicts the hidden ones."""

    def __init__(self, cfg: MAEConfig, encoder: nn.Module | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        encoder = encoder if encoder is not None else vision_encoder(cfg.encoder, **cfg.encoder_overrides)
        if isinstance(encoder, SwinTransformer):
            raise UsageError(f"MAE drops the hidden patches, which {cfg.encoder}'s windows cannot do (they partition "
                             "the whole grid): pre-train Swin with SimMIM (--model.objective simmim)")
        if not isinstance(encoder, VisionTransformer):
            raise UsageError(f"MAE pre-trains a ViT, got {type(encoder).__name__}")
        if encoder.merging:
            raise UsageError("MAE encodes a random subset of the patches: turn token merging off (token_merging=0)")
        self.encoder = encoder
        C, Cd, p = encoder.num_features, cfg.decoder_embed_dim, encoder.patch_size
        self.patch_size, self.in_chans = p, encoder.in_chans
        self.decoder_embed = nn.Linear(C, Cd)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, Cd))
        self.register_buffer("decoder_pos_embed", self.decoder_positions(encoder.cfg.grid_size))  # (1, P + N, Cd)
        norm = partial(nn.LayerNorm, eps=cfg.norm_eps)
        self.decoder_blocks = nn.Sequential(*[
            Block(Cd, Attention(Cd, cfg.decoder_num_heads, backend=cfg.attn_backend),
                  Mlp(Cd, int(Cd * cfg.decoder_mlp_ratio)), norm_layer=norm) for _ in range(cfg.decoder_depth)])
        self.decoder_norm = norm(Cd)
        self.decoder_pred = nn.Linear(Cd, p * p * self.in_chans)
        self.reset_decoder()

    def decoder_positions(self, grid: tuple[int, int]) -> Tensor:
        """Fixed 2-D sin-cos positions of the decoder, zeros for the prefix tokens: (1, P + N, Cd), the column's
        channels first, as in Meta's code (which its decoder weights were trained with)."""
        pe = sincos_2d(grid, self.cfg.decoder_embed_dim)
        half = pe.shape[1] // 2
        pe = torch.cat([pe[:, half:], pe[:, :half]], dim=1)
        return torch.cat([pe.new_zeros(self.encoder.num_prefix_tokens, pe.shape[1]), pe])[None]

    def reset_decoder(self) -> None:
        """MAE's initialisation of the decoder: xavier-uniform linears, zero biases, a small mask token."""
        for m in [self.decoder_embed, self.decoder_pred, *self.decoder_blocks.modules()]:
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
        nn.init.normal_(self.mask_token, std=0.02)

    def random_masking(self, B: int, N: int, noise: Tensor | None, device: torch.device):
        """Per-sample random masking by the order of ``noise`` (B, N) (uniform when None): the lowest values are
        kept. Returns the kept indices (B, K), the mask (B, N) (1: hidden) and the order that restores (B, N)."""
        K = int(N * (1 - self.cfg.mask_ratio))
        if K < 1:
            raise UsageError(f"mask_ratio {self.cfg.mask_ratio} of {N} patches leaves none visible")
        noise = torch.rand(B, N, device=device) if noise is None else noise.to(device)
        shuffle = noise.argsort(dim=1)
        restore = shuffle.argsort(dim=1)
        mask = torch.ones(B, N, device=device)
        mask[:, :K] = 0
        return shuffle[:, :K], mask.gather(1, restore), restore

    def forward_encoder(self, images: Tensor, noise: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Images -> (the encoded visible tokens (B, P + K, C), the mask (B, N), the order that restores)."""
        check_divides(images, self.patch_size, "patch size")
        patches, grid = self.encoder.embed_patches(images)  # (B, N, C)
        keep, mask, restore = self.random_masking(patches.shape[0], patches.shape[1], noise, images.device)
        tokens, rope = self.encoder.embed_tokens(patches, grid, keep)  # (B, P + K, C)
        return self.encoder.forward_blocks(tokens, rope), mask, restore

    def forward_decoder(self, latent: Tensor, restore: Tensor, grid: tuple[int, int]) -> Tensor:
        """(B, P + K, C) encoded tokens -> (B, N, p·p·c) predicted pixels of every patch."""
        P = self.encoder.num_prefix_tokens
        x = self.decoder_embed(latent)  # (B, P + K, Cd)
        B, _, Cd = x.shape
        N = restore.shape[1]
        patches = torch.cat([x[:, P:], self.mask_token.expand(B, N - (x.shape[1] - P), Cd)], dim=1)  # (B, N, Cd)
        patches = patches.gather(1, restore[..., None].expand(-1, -1, Cd))  # back in grid order
        pos = self.decoder_pos_embed if self.decoder_pos_embed.shape[1] == P + N else \
            self.decoder_positions(grid).to(x)
        x = torch.cat([x[:, :P], patches], dim=1) + pos
        x = self.decoder_norm(self.decoder_blocks(x))
        return self.decoder_pred(x)[:, P:]  # (B, N, p·p·c)

    def target(self, images: Tensor) -> Tensor:
        """The patches the decoder learns to predict: raw, or with ``norm_pix_loss`` normalised per patch."""
        return self._normalised(patchify(images, self.patch_size))

    def _normalised(self, t: Tensor) -> Tensor:
        """Patches (..., p·p·c) as the loss takes them: with ``norm_pix_loss`` each normalised to its own mean and
        spread."""
        if self.cfg.norm_pix_loss:
            t = (t - t.mean(dim=-1, keepdim=True)) / (t.var(dim=-1, keepdim=True) + 1e-6) ** 0.5
        return t

    @property
    def num_prefix_tokens(self) -> int:
        return self.encoder.num_prefix_tokens

    def token_drop_refusal(self, drop: float) -> str:
        """Why packed batches for MAE take every patch (the data module's ``--data.token_drop`` says so)."""
        return (f"--data.packing with MAE: --data.token_drop {drop:g} would drop patches before MAE hides its own "
                f"share (--model.mask_ratio {self.cfg.mask_ratio:g}); leave it at 0")

    def forward_packed(self, batch: PackedBatch, generator: torch.Generator | None = None) -> MIMOutput:
        """Images of their own sizes, packed (``packing.pack``, every patch) -> the loss over each image's hidden
        patches, the prediction (S, L, p·p·c) and the hidden slots (S, L), both in ``batch``'s slots. Each image
        keeps ``1 - mask_ratio`` of its patches, drawn by ``generator``; the visible patches are packed again, densely,
        for the encoder; the decoder runs every slot of ``batch``, the hidden ones as mask tokens, with its sin-cos
        positions at each image's grid, attention kept inside each image."""
        P = self.encoder.num_prefix_tokens
        if batch.prefix != P or bool(((batch.index >= P) & (batch.image >= 0)).sum() != sum(
                h * w for h, w in batch.grids)):
            raise UsageError(f"MAE takes packed batches of every patch of each image, with {P} prefix token(s): "
                             "pack without token dropping (--data.token_drop 0; MAE's mask_ratio drops patches)")
        visible = pack(batch.images(), self.patch_size, batch.patches.shape[1], P, self.cfg.mask_ratio, generator)
        latent = self.decoder_embed(self.encoder.packed_tokens(visible))  # (S', L', Cd)
        slot = batch.slot_table()  # (images, P + most patches): each token's flat slot in batch
        shown = visible.image >= 0
        into = slot[visible.image[shown], visible.index[shown]]
        x = self.mask_token[0].to(latent.dtype).expand(batch.image.numel(), -1).clone()
        x[into] = latent[shown]
        x = x.view(*batch.image.shape, -1) + grid_rows(batch, lambda grid: self.decoder_positions(grid)[0], x)
        for blk in self.decoder_blocks:
            x = blk(x, None, batch.attn_mask())
        pred = self.decoder_pred(self.decoder_norm(x))  # (S, L, p·p·c)
        hidden = (batch.index >= P).flatten()
        hidden[into] = False
        hidden = hidden.view_as(batch.image)
        loss = ((pred.float() - self._packed_target(batch).float()) ** 2).mean(dim=-1)
        return MIMOutput(loss[hidden].mean(), pred, hidden)

    def _packed_target(self, batch: PackedBatch) -> Tensor:
        """Each slot's pixels (S, L, p·p·c) in MAE's (row, column, channel) order, normalised per patch with
        ``norm_pix_loss``."""
        S, L, D = batch.patches.shape
        p = self.patch_size
        return self._normalised(batch.patches.reshape(S, L, D // (p * p), p, p).permute(0, 1, 3, 4, 2).reshape(S, L, D))

    def forward(self, images: Tensor | PackedBatch, noise: Tensor | torch.Generator | None = None) -> MIMOutput:
        """Images (B, c, H, W) -> the loss (mean squared error over the hidden patches), the prediction, the mask.
        A :class:`PackedBatch` -> :meth:`forward_packed` (``noise``: its generator), so that an EMA and DDP take
        packed batches too."""
        if isinstance(images, PackedBatch):
            return self.forward_packed(images, noise)
        latent, mask, restore = self.forward_encoder(images, noise)
        grid = (images.shape[-2] // self.patch_size, images.shape[-1] // self.patch_size)
        pred = self.forward_decoder(latent, restore, grid)
        loss = ((pred.float() - self.target(images).float()) ** 2).mean(dim=-1)
        return MIMOutput((loss * mask).sum() / mask.sum(), pred, mask)

    @torch.no_grad()
    def reconstruct(self, images: Tensor, noise: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """(the images with the hidden patches zeroed, the visible patches with the prediction pasted into the
        hidden ones, the hidden pixels (B, 1, H, W) bool), in the images' units: normalised predictions are scaled
        back with each patch's own mean and spread."""
        out = self(images, noise)
        pred, raw = out.pred.float(), patchify(images.float(), self.patch_size)
        if self.cfg.norm_pix_loss:
            pred = pred * (raw.var(dim=-1, keepdim=True) + 1e-6) ** 0.5 + raw.mean(dim=-1, keepdim=True)
        grid = (images.shape[-2] // self.patch_size, images.shape[-1] // self.patch_size)
        hidden = out.mask[..., None]
        masked = unpatchify(raw * (1 - hidden), self.patch_size, grid)
        pasted = unpatchify(raw * (1 - hidden) + pred * hidden, self.patch_size, grid)
        return masked, pasted, unpatchify(hidden.expand_as(raw), self.patch_size, grid)[:, :1] > 0


class SimMIM(nn.Module):
    """SimMIM (Xie et al., 2022): hidden patches become a learned mask token at the encoder's input; a one-layer
    head predicts the raw pixels from the final map."""

    cannot_pack = ("SimMIM masks blocks of one fixed grid, so it cannot pre-train on images of their own sizes; "
                   "pre-train a ViT with MAE (--model.objective mae) to pack")

    def __init__(self, cfg: SimMIMConfig, encoder: nn.Module | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        encoder = encoder if encoder is not None else vision_encoder(cfg.encoder, **cfg.encoder_overrides)
        if not isinstance(encoder, (SwinTransformer, VisionTransformer)):
            raise UsageError(f"SimMIM pre-trains a Swin or a ViT, got {type(encoder).__name__}")
        self.encoder = encoder
        swin = isinstance(encoder, SwinTransformer)
        p = encoder.patch_size
        self.patch_size = p
        self.stride = p * 2 ** (len(encoder.cfg.depths) - 1) if swin else p  # pixels per final-map position
        if cfg.mask_patch_size % p:
            raise UsageError(f"mask_patch_size {cfg.mask_patch_size} must be a multiple of the encoder's patch size "
                             f"{p}")
        check_divides(torch.empty(1, 1, *pair(encoder.cfg.img_size)), cfg.mask_patch_size,
                      "mask block (mask_patch_size)")
        width = encoder.num_features
        self.mask_token = nn.Parameter(torch.zeros(1, 1, encoder.patch_embed.proj.out_channels))
        nn.init.trunc_normal_(self.mask_token, std=0.02)
        in_chans = encoder.in_chans
        self.decoder = nn.Sequential(nn.Conv2d(width, self.stride**2 * in_chans, kernel_size=1),
                                     nn.PixelShuffle(self.stride))

    def random_mask(self, B: int, size: tuple[int, int], device: torch.device,
                    generator: torch.Generator | None = None) -> Tensor:
        """(B, N) bool, True: hidden, at the encoder's patch grid: ``mask_ratio`` of the mask blocks (rounded up)."""
        m = self.cfg.mask_patch_size
        h, w = size[0] // m, size[1] // m
        count = math.ceil(h * w * self.cfg.mask_ratio)  # rounded up, as SimMIM's code
        order = torch.rand(B, h * w, generator=generator).to(device).argsort(dim=1)
        blocks = torch.zeros(B, h * w, dtype=torch.bool, device=device).scatter_(1, order[:, :count], True)
        s = m // self.patch_size
        return blocks.view(B, h, 1, w, 1).expand(B, h, s, w, s).reshape(B, h * s * w * s)

    def encode(self, images: Tensor, mask: Tensor) -> Tensor:
        """Images with the hidden patches replaced by the mask token -> the final map (B, C, H/stride, W/stride)."""
        enc = self.encoder
        if isinstance(enc, SwinTransformer):
            x = enc.embed_patches(images)  # (B, h, w, C0), after the patch embedding's norm
            B, h, w, C0 = x.shape
            keep = 1 - mask.view(B, h, w, 1).to(x)
            x = enc.norm(enc.layers(x * keep + self.mask_token.view(1, 1, 1, C0) * (1 - keep)))
            return x.permute(0, 3, 1, 2)  # (B, C, h', w')
        patches, grid = enc.embed_patches(images)  # (B, N, C)
        keep = 1 - mask[..., None].to(patches)
        tokens, rope = enc.embed_tokens(patches * keep + self.mask_token * (1 - keep), grid)
        x = enc.forward_blocks(tokens, rope)[:, enc.num_prefix_tokens:]  # (B, N, C)
        return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], grid[0], grid[1])

    def forward(self, images: Tensor, mask: Tensor | None = None) -> MIMOutput:
        """Images (B, c, H, W) and the hidden patches (B, N) (drawn when None) -> the loss (L1 over the hidden
        pixels), the reconstructed images, the mask."""
        check_image(images, self.encoder.in_chans, None, "SimMIM")
        check_divides(images, self.cfg.mask_patch_size, "mask block (mask_patch_size)")
        check_divides(images, self.stride, "encoder's total stride")
        B, c, H, W = images.shape
        mask = self.random_mask(B, (H, W), images.device) if mask is None else mask.to(images.device).bool()
        if mask.shape != (B, (H // self.patch_size) * (W // self.patch_size)):
            raise UsageError(f"mask must be (B, N) = ({B}, {(H // self.patch_size) * (W // self.patch_size)}) for "
                             f"{H}x{W} images, got {tuple(mask.shape)}")
        pred = self.decoder(self.encode(images, mask))  # (B, c, H, W)
        p = self.patch_size
        pixels = mask.view(B, 1, H // p, W // p).repeat_interleave(p, 2).repeat_interleave(p, 3).to(pred)
        l1 = F.l1_loss(pred.float(), images.float(), reduction="none")
        return MIMOutput((l1 * pixels).sum() / (pixels.sum() + 1e-5) / c, pred, mask)

    @torch.no_grad()
    def reconstruct(self, images: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """(the images with the hidden patches zeroed, the prediction pasted into the hidden ones, the hidden
        pixels (B, 1, H, W) bool)."""
        B, _, H, W = images.shape
        mask = self.random_mask(B, (H, W), images.device) if mask is None else mask.bool()
        out = self(images, mask)
        p = self.patch_size
        pixels = mask.view(B, 1, H // p, W // p).repeat_interleave(p, 2).repeat_interleave(p, 3).to(images)
        return images * (1 - pixels), images * (1 - pixels) + out.pred.to(images) * pixels, pixels > 0


__all__ = ["MAEConfig", "MIMOutput", "MaskedAutoencoder", "SimMIM", "SimMIMConfig", "patchify", "unpatchify"]
