"""Images of their own sizes packed into sequences (NaViT, Dehghani et al., 2023): each image's patch tokens, and its
prefix (class, registers) tokens, take consecutive slots of a sequence of at most ``max_tokens``; several images
share a sequence, and attention stays within each image (a block-diagonal mask on the one attention core, which
every backend takes). Positions are the model's own, resampled to each image's patch grid, as for one image of that
size; so a packed forward gives, image by image, the logits of the image run alone.

Shape legend: S packed sequences, L slots each (``max_tokens``), P the pixels of a patch (C_in·p·p, channel-major:
the patch embedding's own order), C the model width.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from vitkit.errors import UsageError
from vitkit.layers.pos_embed import rope_tables
from vitkit.patch_budget import budget_size


@dataclass
class PackedBatch:
    """Images packed into sequences. ``patches`` (S, L, P): each slot's pixels (zeros for prefix and padding
    slots); ``image`` (S, L): the index, in the order given, of the image a slot holds (-1: padding); ``index``
    (S, L): the slot's place in its image's own token sequence (the prefix tokens first, then the patches row by
    row; -1: padding); ``grids``: each image's patch grid (rows, columns)."""

    patches: Tensor
    image: Tensor
    index: Tensor
    grids: list[tuple[int, int]]
    prefix: int

    def __len__(self) -> int:
        """The images packed."""
        return len(self.grids)

    def images(self) -> list[Tensor]:
        """Each image (C_in, H, W) again, from its patches' pixels, in the order given."""
        out = []
        for i, (rows, cols) in enumerate(self.grids):
            slots = (self.image == i) & (self.index >= self.prefix)
            pixels = self.patches.new_zeros(rows * cols, self.patches.shape[-1])  # a dropped patch stays zeros
            pixels[self.index[slots] - self.prefix] = self.patches[slots]  # (rows·cols, C_in·p·p), row by row
            p = math.isqrt(pixels.shape[-1] // self._channels())
            out.append(pixels.reshape(rows, cols, -1, p, p).permute(2, 0, 3, 1, 4).reshape(-1, rows * p, cols * p))
        return out

    def _channels(self) -> int:
        for c in (3, 1, 4, 2):  # the first that leaves square patches (as a NaFlex file's projection is read)
            p = math.isqrt(self.patches.shape[-1] // c)
            if p * p * c == self.patches.shape[-1]:
                return c
        raise UsageError(f"patches of {self.patches.shape[-1]} values are no square patch of 1 to 4 channels")

    def to(self, device: torch.device | str) -> PackedBatch:
        return dataclasses.replace(self, patches=self.patches.to(device), image=self.image.to(device),
                                   index=self.index.to(device))

    @property
    def padding(self) -> float:
        """The share of slots that hold no token."""
        return float((self.image < 0).float().mean())

    def slot_table(self) -> Tensor:
        """(images, longest token sequence): the flat slot (in ``image.flatten()``) of image i's token j, or -1 where
        image i has no token j (a shorter sequence, a dropped patch)."""
        shown = self.image >= 0
        table = self.image.new_full((len(self), int(self.index.max()) + 1), -1)
        slots = torch.arange(self.image.numel(), device=shown.device).view_as(self.image)
        table[self.image[shown], self.index[shown]] = slots[shown]
        return table

    def attn_mask(self) -> Tensor:
        """(S, 1, L, L) bool: a slot attends to the slots of its own image (padding to padding alone, so no row is
        empty)."""
        return (self.image[:, :, None] == self.image[:, None, :])[:, None]


def pack(images: list[Tensor], patch_size: int, max_tokens: int, prefix: int = 1, drop: float = 0.0,
         generator: torch.Generator | None = None) -> PackedBatch:
    """``images`` ((C_in, H, W) each, H and W multiples of ``patch_size``) packed into sequences of ``max_tokens``
    slots: the largest first, each into the first sequence with room for its prefix and patches (first-fit
    decreasing), a new sequence where none has. ``drop``: each image loses that share of its patches, drawn at random
    by ``generator`` (NaViT's token dropping; at least one patch stays), its other patches keeping their places."""
    if not images:
        raise UsageError("pack takes at least one image")
    if not 0.0 <= drop < 1.0:
        raise UsageError(f"drop is the share of each image's patches left out, in [0, 1); got {drop}")
    kept = []
    for i, img in enumerate(images):
        if img.dim() != 3 or img.shape[-2] % patch_size or img.shape[-1] % patch_size or \
                img.shape[0] != images[0].shape[0]:
            raise UsageError(f"image {i}: expected (C, H, W) with H and W multiples of the patch size {patch_size} "
                             f"and image 0's {images[0].shape[0]} channels, got {tuple(img.shape)}")
        n = (img.shape[-2] // patch_size) * (img.shape[-1] // patch_size)
        keep = max(1, round(n * (1 - drop)))
        kept.append(torch.arange(n) if keep == n else torch.randperm(n, generator=generator)[:keep].sort().values)
    sizes = [prefix + len(k) for k in kept]
    if max(sizes) > max_tokens:
        i = max(range(len(sizes)), key=sizes.__getitem__)
        raise UsageError(f"max_tokens {max_tokens} is smaller than image {i}'s {sizes[i]} tokens "
                         f"({tuple(images[i].shape[-2:])} in {patch_size} px patches, with {prefix} prefix); give "
                         f"at least {max(sizes)}, or smaller images")
    room: list[int] = []
    where: list[tuple[int, int]] = [(0, 0)] * len(images)  # (sequence, first slot)
    for i in sorted(range(len(images)), key=lambda i: -sizes[i]):
        s = next((s for s, free in enumerate(room) if free >= sizes[i]), len(room))
        if s == len(room):
            room.append(max_tokens)
        where[i] = (s, max_tokens - room[s])
        room[s] -= sizes[i]
    first = images[0]
    P = first.shape[0] * patch_size ** 2
    patches = first.new_zeros(len(room), max_tokens, P)
    image = torch.full((len(room), max_tokens), -1, dtype=torch.long, device=first.device)
    index = torch.full_like(image, -1)
    grids = []
    for i, (img, (s, at)) in enumerate(zip(images, where, strict=True)):
        rows, cols = img.shape[-2] // patch_size, img.shape[-1] // patch_size
        grids.append((rows, cols))
        flat = img.unfold(1, patch_size, patch_size).unfold(2, patch_size, patch_size)  # (C, rows, cols, p, p)
        take = kept[i].to(first.device)
        patches[s, at + prefix:at + sizes[i]] = flat.permute(1, 2, 0, 3, 4).reshape(rows * cols, P)[take]
        image[s, at:at + sizes[i]] = i
        index[s, at:at + sizes[i]] = torch.cat([torch.arange(prefix, device=first.device), prefix + take])
    return PackedBatch(patches, image, index, grids, prefix)


def from_naflex(batch: dict[str, Tensor], patch_size: int, prefix: int) -> PackedBatch:
    """timm's padded NaFlex batch (its loader's dict: ``patches`` (B, N, p·p·C_in) in row, column, channel order,
    ``patch_coord`` (B, N, 2) each patch's row and column in its image, ``patch_valid`` (B, N)) as a packed batch
    of one image a sequence, its padding marked: ``forward_packed`` of it gives timm's outputs for that batch."""
    missing = [k for k in ("patches", "patch_coord", "patch_valid") if k not in batch]
    if missing:
        raise UsageError(f"a NaFlex batch holds patches, patch_coord and patch_valid; this one lacks {missing}")
    patches, coord, valid = batch["patches"], batch["patch_coord"].long(), batch["patch_valid"].bool()
    chans = patches.shape[-1] // patch_size ** 2 if patches.dim() == 3 else 0
    if not chans or chans * patch_size ** 2 != patches.shape[-1]:
        raise UsageError(f"NaFlex patches must be (B, N, {patch_size}·{patch_size}·C) for the model's "
                         f"{patch_size}-px patches, got {tuple(patches.shape)}")
    if not bool(valid.any(dim=1).all()):
        raise UsageError("a NaFlex batch row has no valid patch (patch_valid all False)")
    B, N, P = patches.shape
    pixels = patches.reshape(B, N, patch_size, patch_size, chans).permute(0, 1, 4, 2, 3).reshape(B, N, P)
    rows = coord[..., 0].masked_fill(~valid, -1).amax(dim=1) + 1
    cols = coord[..., 1].masked_fill(~valid, -1).amax(dim=1) + 1
    owner = torch.arange(B, device=patches.device)[:, None]
    image = torch.cat([owner.expand(B, prefix), torch.where(valid, owner, -1)], dim=1)
    at = prefix + coord[..., 0] * cols[:, None] + coord[..., 1]
    index = torch.cat([torch.arange(prefix, device=patches.device).expand(B, prefix), torch.where(valid, at, -1)],
                      dim=1)
    packed = torch.cat([pixels.new_zeros(B, prefix, P), pixels * valid[..., None].to(pixels.dtype)], dim=1)
    return PackedBatch(packed, image, index, list(zip(rows.tolist(), cols.tolist(), strict=True)), prefix)


def embed_packed(model, batch: PackedBatch, mask: Tensor | None = None,
                 mask_token: Tensor | None = None) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
    """A ViT's blocks' input for a packed batch, (S, L, C), and its RoPE tables per slot ((S, 1, L, ·) each, or
    None): the patch embedding as a linear map of each patch's pixels, the prefix tokens, and each image's
    positions resampled to its grid, as ``VisionTransformer.embed_tokens`` gives them for that image alone. With
    ``mask`` ((S, L) bool), the patches there are ``mask_token`` ((C,) or broadcastable) before their positions
    (DINO's iBOT)."""
    if batch.prefix != model.num_prefix_tokens:
        raise UsageError(f"the batch was packed with {batch.prefix} prefix token(s); {_name(model)} has "
                         f"{model.num_prefix_tokens}: pack with prefix={model.num_prefix_tokens}")
    proj = model.patch_embed.proj
    is_patch = batch.index >= batch.prefix
    tokens = model.patch_embed.norm(F.linear(batch.patches[is_patch], proj.weight.flatten(1), proj.bias))
    x = tokens.new_zeros(*batch.image.shape, proj.out_channels)  # the dtype autocast gives the tokens
    x[is_patch] = tokens
    if mask is not None:
        x = torch.where((mask & is_patch)[..., None], mask_token.reshape(-1).to(x.dtype), x)
    prefix = [t for t in (model.cls_token, model.dist_token, model.reg_token) if t is not None]
    if prefix:
        is_prefix = (batch.index >= 0) & ~is_patch
        x[is_prefix] = torch.cat(prefix, dim=1)[0][batch.index[is_prefix]].to(x.dtype)
    rope = _slot_tables(model, batch, x) if model.rope_kind else None
    if model.pos_embed is not None:
        lead = 0 if model.no_embed_class else model.num_prefix_tokens
        x = x + grid_rows(batch, lambda grid: model.positions_for(grid)[0], x, batch.prefix - lead)  # (lead + h·w, C)
    return model.norm_pre(model.pos_drop(x)), rope


def _name(model) -> str:
    return getattr(model, "name", type(model).__name__)


def grid_rows(batch: PackedBatch, table_for, like: Tensor, skip: int = 0) -> Tensor:
    """(S, L, C) like ``like``: each slot's row of its image's table ``table_for(grid)`` ((rows, C), the slot's row
    its ``index - skip``), zeros for padding and for the first ``skip`` tokens of each image. Positions per image
    grid: the ViT's resampled ones, MAE's decoder's sin-cos ones."""
    out = like.new_zeros(*batch.image.shape, like.shape[-1])
    for grid in set(batch.grids):
        slots = _slots_of_grid(batch, grid) & (batch.index >= skip)
        out[slots] = table_for(grid)[batch.index[slots] - skip].to(out.dtype)
    return out


def class_tokens(x: Tensor, batch: PackedBatch) -> Tensor:
    """Each image's first token (its class token) of the tokens ``x`` (S, L, C): (images, C), in the order packed."""
    first = batch.index == 0
    out = x.new_zeros(len(batch), x.shape[-1])
    out[batch.image[first]] = x[first]
    return out


def _slots_of_grid(batch: PackedBatch, grid: tuple[int, int]) -> Tensor:
    """(S, L) bool: the slots of the images of patch grid ``grid``."""
    ids = torch.tensor([i for i, g in enumerate(batch.grids) if g == grid], device=batch.image.device)
    return torch.isin(batch.image, ids)


def _slot_tables(model, batch: PackedBatch, x: Tensor) -> tuple[Tensor, Tensor]:
    """Each slot's RoPE row, from the tables of its image's grid (padding: no rotation)."""
    if model.rope is not None:
        raise UsageError(f"{_name(model)}: packing takes fixed RoPE tables (dinov3, axial); learned per-block "
                         "frequencies (rope 'mixed') are not packed")
    cos = sin = None
    for grid in set(batch.grids):
        c, s = rope_tables(model.rope_kind, grid, model.head_dim, model.rope_temperature, model.num_prefix_tokens,
                           x.device, model.rope_xy, model.rope_ref_grid)
        if cos is None:
            cos, sin = x.new_ones(*batch.image.shape, c.shape[-1]), x.new_zeros(*batch.image.shape, c.shape[-1])
        slots = _slots_of_grid(batch, grid)
        cos[slots], sin[slots] = c[batch.index[slots]].to(x.dtype), s[batch.index[slots]].to(x.dtype)
    return cos[:, None], sin[:, None]


def pool_packed(model, x: Tensor, batch: PackedBatch) -> Tensor:
    """The normed tokens (S, L, C) -> each image's pooled features (images, C), in the order given: its class
    token, the mean / max of its patch tokens, or the attention pool over its tokens, by the model's
    ``global_pool``."""
    n = len(batch.grids)
    pool = model.global_pool
    other = "distilled heads" if model.head_dist is not None else \
        None if pool in ("token", "avg", "max", "avgmax", "map") else repr(pool)
    if other is not None:
        raise UsageError(f"{_name(model)}: packed batches pool by the class token, avg, max, avgmax or map; not "
                         f"{other}")
    flat, image, index = x.reshape(-1, x.shape[-1]), batch.image.reshape(-1), batch.index.reshape(-1)
    if model.attn_pool is not None:
        tokens, pad = _per_image(flat, image, index >= (0 if model.map_prefix else batch.prefix), n)
        return model.attn_pool(tokens, key_padding_mask=pad)
    if pool == "token":
        return class_tokens(x, batch)
    patch = index >= batch.prefix
    ids, tokens = image[patch], flat[patch]
    mean = x.new_zeros(n, x.shape[-1]).index_add_(0, ids, tokens)
    mean = mean / torch.bincount(ids, minlength=n).clamp(min=1)[:, None].to(x.dtype)
    if pool == "avg":
        return mean
    top = x.new_full((n, x.shape[-1]), float("-inf")).scatter_reduce(0, ids[:, None].expand_as(tokens), tokens,
                                                                     "amax")
    return top if pool == "max" else 0.5 * (mean + top)


def _per_image(flat: Tensor, image: Tensor, take: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """The slots ``take`` of each of ``n`` images, gathered from the flat slots (S·L, C) into (n, longest, C) in
    slot order, and (n, longest) True where an image has fewer."""
    slots = torch.nonzero(take).squeeze(1)
    ids = image[slots]
    order = torch.argsort(ids, stable=True)
    slots, ids = slots[order], ids[order]
    counts = torch.bincount(ids, minlength=n)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(len(ids), device=ids.device) - starts[ids]  # each slot's place among its image's
    out = flat.new_zeros(n, int(counts.max()), flat.shape[-1])
    out[ids, rank] = flat[slots]
    pad = torch.arange(out.shape[1], device=ids.device)[None] >= counts[:, None]
    return out, pad


class PackCollate:
    """A ``DataLoader``'s ``collate_fn`` for images of their own sizes: samples of (image (C_in, H, W) float, label)
    become (:class:`PackedBatch`, labels (n,)), each image resized (bilinear, antialiased) to the largest size of its
    aspect ratio within ``max_patches`` patches (:func:`budget_size`), then packed into sequences of
    ``max_tokens``. ``prefix``: the model's prefix tokens per image (``model.num_prefix_tokens``); ``drop``: the share
    of each image's patches left out (:func:`pack`; for training)."""

    def __init__(self, patch_size: int, max_tokens: int, max_patches: int, prefix: int = 1,
                 drop: float = 0.0) -> None:
        if max_patches + prefix > max_tokens:
            raise UsageError(f"max_tokens {max_tokens} is smaller than one image's {max_patches} patches and "
                             f"{prefix} prefix token(s); give max_tokens >= {max_patches + prefix}")
        self.patch_size, self.max_tokens, self.max_patches, self.prefix = patch_size, max_tokens, max_patches, prefix
        self.drop = drop

    def resize(self, image: Tensor) -> Tensor:
        size = budget_size(image.shape[-2], image.shape[-1], self.patch_size, self.max_patches)
        if tuple(image.shape[-2:]) == size:
            return image
        return F.interpolate(image[None].float(), size=size, mode="bilinear", antialias=True, align_corners=False)[0]

    def __call__(self, samples: list[tuple[Tensor, int]]) -> tuple[PackedBatch, Tensor]:
        images = [self.resize(image) for image, _ in samples]
        labels = torch.as_tensor([label for _, label in samples])
        return pack(images, self.patch_size, self.max_tokens, self.prefix, self.drop), labels
