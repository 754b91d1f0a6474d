"""A ViT classifier exported on packed batches: images of their own sizes in sequences of any length, with any
number of images and sequences, as ONNX (checked in onnxruntime) or a ``torch.export`` program.

``model.forward_packed`` loops over a batch's grids and gathers with boolean masks, whose sizes depend on the data;
:class:`PackedGraph` computes the same logits in dense tensor ops whose sizes are the inputs' alone, so the export
keeps the sequence count, the sequence length and the image count symbolic:

- each slot's position is the learned table resampled to its image's grid, from per-slot resize weights
  (``layers.resample.resample_weights``: the weights of ``F.interpolate``'s antialiased resize, computed from the
  grid sizes in the graph), instead of one ``F.interpolate`` per grid;
- each slot's RoPE rotation (DINOv3's or axial) comes from its patch row and column and its image's grid, in the
  graph (``rope_2d_angles``, ``rope_axial_angles``: what builds the model's own tables);
- attention stays within each image by the block-diagonal mask the image ids give (the one attention core);
- pooling reads each image's tokens through a table from (image, token) to slot built by a scatter.

The inputs are :class:`~vitkit.models.packing.PackedBatch`'s fields: ``patches`` (S, L, P) float32, ``image`` and
``index`` (S, L) int64, and ``grids`` (images, 2) int64 (each image's patch rows and columns); the output is
``logits`` (images, classes) in image order. ``OnnxModel`` runs the file on packed arrays (``run_packed``), or on
images of one size, each one sequence (``onnx_model.pack_arrays``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vitkit.errors import UsageError
from vitkit.layers.pos_embed import rope_2d_angles, rope_axial_angles
from vitkit.layers.resample import resample_weights
from vitkit.models.packing import PackedBatch, pack

from .export import ATOL, OPSET, ExportError, ExportReport, _accept, _failed, metadata, prepare

PACKED_INPUTS = ("patches", "image", "index", "grids")
PACKED_OUTPUT = "logits"


class PackedGraph(nn.Module):
    """``model.forward_packed`` in ops of static rank and input-sized shapes (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        refusal = packed_export_refusal(model)
        if refusal:
            raise ExportError(refusal)
        self.model = model
        self.prefix = model.num_prefix_tokens
        self.lead = 0 if model.no_embed_class else self.prefix  # positions rows before the grid's

    def forward(self, patches: Tensor, image: Tensor, index: Tensor, grids: Tensor) -> Tensor:
        m = self.model
        S, L = image.shape
        n = grids.shape[0]
        is_patch = (index >= self.prefix)[..., None]
        proj = m.patch_embed.proj
        x = m.patch_embed.norm(F.linear(patches, proj.weight.flatten(1), proj.bias))  # (S, L, C)
        x = torch.where(is_patch, x, torch.zeros_like(x))
        tokens = [t for t in (m.cls_token, m.dist_token, m.reg_token) if t is not None]
        if tokens:
            first = torch.cat(tokens, dim=1)[0][index.clamp(0, self.prefix - 1)]  # (S, L, C)
            x = torch.where(((index >= 0) & (index < self.prefix))[..., None], first, x)
        cells = self.cells(image, index, grids)
        if m.pos_embed is not None:
            x = x + self.positions(index, *cells)
        x = m.norm_pre(m.pos_drop(x))
        rope = self.rope_tables(index, *cells) if m.rope_kind else None
        mask = (image[:, :, None] == image[:, None, :])[:, None]  # (S, 1, L, L): within each image
        for blk in m.blocks:
            x = blk(x, None, mask, None, False, rope)
        x = m.norm(x).reshape(S * L, -1)
        shown = image.reshape(-1) >= 0
        key = torch.where(shown, image.reshape(-1) * L + index.reshape(-1), n * L)  # padding -> one spare cell
        slot = torch.full((n * L + 1,), -1, dtype=torch.long, device=x.device)
        slot = slot.scatter(0, key, torch.arange(S * L, device=x.device))[:-1].reshape(n, L)  # (images, L)
        pooled = self.pool(x[slot.clamp(min=0)], slot >= 0)
        return m.head(m.head_drop(m.fc_norm(pooled)))

    def cells(self, image: Tensor, index: Tensor, grids: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Each slot's patch row and column in its image, and that image's grid rows and columns: (S, L) each
        (row and column 0 for prefix and padding slots)."""
        rows_cols = grids[image.clamp(min=0)]  # (S, L, 2)
        h, w = rows_cols[..., 0], rows_cols[..., 1]
        cell = (index - self.prefix).clamp(min=0)
        return cell // w, cell % w, h, w

    def rope_tables(self, index: Tensor, r: Tensor, c: Tensor, h: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
        """Each slot's RoPE rows (S, 1, L, ·), as ``rope_tables`` gives them for its image's grid (prefix and padding
        slots: no rotation)."""
        m = self.model
        if m.rope_kind == "dinov3":
            angles = rope_2d_angles(r, c, h, w, m.head_dim, m.rope_temperature)
        else:
            angles = rope_axial_angles(r, c, h, w, m.head_dim, m.rope_temperature, m.rope_xy, m.rope_ref_grid)
        angles = torch.where((index >= self.prefix)[..., None], angles, torch.zeros_like(angles))
        return angles.cos()[:, None], angles.sin()[:, None]

    def positions(self, index: Tensor, r: Tensor, c: Tensor, h: Tensor, w: Tensor) -> Tensor:
        """(S, L, C): each slot's row of its image's positions, as ``model.positions_for(grid)`` gives them."""
        m = self.model
        pos = m.pos_embed[0].float()  # (lead + gh·gw, C)
        gh, gw = m.pos_grid
        if m.pos_keep_aspect:  # to the longer side's square, then its first rows and columns
            h = w = torch.maximum(h, w)
        wy = resample_weights(r, h, gh, m.pos_interp)  # (S, L, gh)
        wx = resample_weights(c, w, gw, m.pos_interp)  # (S, L, gw)
        weights = (wy[..., :, None] * wx[..., None, :]).flatten(2)  # (S, L, gh·gw)
        out = weights @ pos[self.lead:]  # (S, L, C)
        is_patch = (index >= self.prefix)[..., None]
        if self.lead:
            lead = pos[:self.lead][index.clamp(0, self.lead - 1)]
            out = torch.where(is_patch, out, torch.where((index >= 0)[..., None], lead, torch.zeros_like(out)))
        else:
            out = torch.where(is_patch, out, torch.zeros_like(out))
        return out.to(m.pos_embed.dtype)

    def pool(self, tokens: Tensor, have: Tensor) -> Tensor:
        """Each image's tokens (images, L, C) in its own order (prefix first), ``have`` False past its last ->
        its pooled features, by the model's ``global_pool``."""
        m = self.model
        if m.attn_pool is not None:
            start = 0 if m.map_prefix else self.prefix
            return m.attn_pool(tokens[:, start:], key_padding_mask=~have[:, start:])
        if m.global_pool == "token":
            return tokens[:, 0]
        patch = have.clone()
        patch[:, :self.prefix] = False
        mean = (tokens * patch[..., None]).sum(1) / patch.sum(1, keepdim=True).clamp(min=1)
        if m.global_pool == "avg":
            return mean
        top = torch.where(patch[..., None], tokens, torch.full_like(tokens, float("-inf"))).amax(1)
        return top if m.global_pool == "max" else 0.5 * (mean + top)


def packed_export_refusal(model: nn.Module) -> str | None:
    """Why ``model`` cannot be exported on packed batches, in one line, or None."""
    from vitkit.models.vit import VisionTransformer

    name = getattr(model, "name", type(model).__name__)
    if not isinstance(model, VisionTransformer):
        return f"{name}: packed export takes ViT classifiers (images of their own sizes packed into sequences); " \
               f"Swin's windows need whole windows of one image"
    if model.rope is not None:
        return f"{name}: packed export takes fixed RoPE tables (dinov3, axial); learned per-block frequencies (rope " \
               "'mixed') are not packed"
    if model.head_dist is not None or model.global_pool not in ("token", "avg", "max", "avgmax", "map"):
        return f"{name}: packed export pools by the class token, avg, max, avgmax or map; not " + \
            ("distilled heads" if model.head_dist is not None else repr(model.global_pool))
    if not model.pos_antialias:
        return f"{name}: packed export resamples positions antialiased; this model's are not (pos_antialias false)"
    if model.merging:
        return f"{name}: token merging removes tokens per sequence, not per packed image: export it without --packed"
    return None


def _check_batches(model: nn.Module) -> list[PackedBatch]:
    """Two packings of images of several shapes (non-square, one row, one column): several images a sequence, and
    other lengths, image counts and sequence counts."""
    g = torch.Generator().manual_seed(0)
    p, c = model.patch_size, model.in_chans
    gh, gw = model.pos_grid
    shapes = [(gh, gw), (max(1, gh // 2), gw + 2), (1, 3), (3, 1), (gh + 1, max(1, gw - 1))]
    images = [torch.randn(c, r * p, k * p, generator=g) for r, k in shapes]
    longest = max(r * k for r, k in shapes) + model.num_prefix_tokens
    return [pack(images, p, 2 * longest, model.num_prefix_tokens), pack(images[1:4], p, longest + 3,
                                                                        model.num_prefix_tokens)]


def _inputs(batch: PackedBatch) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return batch.patches, batch.image, batch.index, torch.tensor(batch.grids, dtype=torch.long).reshape(-1, 2)


def _dims(prefix: int) -> tuple:
    seqs = torch.export.Dim("sequences", min=1, max=4096)
    slots = torch.export.Dim("slots", min=prefix + 1, max=65536)
    images = torch.export.Dim("images", min=1, max=65536)
    return ({0: seqs, 1: slots}, {0: seqs, 1: slots}, {0: seqs, 1: slots}, {0: images})


def packed_metadata(m: nn.Module) -> dict[str, str]:
    """The export's metadata (``export.metadata``) and how its inputs were packed: the prefix tokens per image, the
    patch size, and the patch budget each image is resized within (the model's, or its trained grid's)."""
    gh, gw = m.pos_grid
    budget = getattr(m.cfg, "max_patches", None) or gh * gw
    return {**metadata(m, True), "vitkit.packed": "true", "vitkit.prefix": json.dumps(m.num_prefix_tokens),
            "vitkit.patch_size": json.dumps(m.patch_size), "vitkit.max_patches": json.dumps(budget)}


def export_packed(model: nn.Module, path: str | os.PathLike, *, fmt: str = "onnx", opset: int = OPSET,
                  atol: float = ATOL) -> ExportReport:
    """Write ``model``'s packed forward (:class:`PackedGraph`) as ONNX (``fmt="onnx"``) or a .pt2, the sequence
    count, the sequence length and the image count dynamic; check it on two packings against ``forward_packed``."""
    if fmt == "onnx" and opset < 18:
        raise UsageError(f"opset must be 18 or newer, got {opset}")
    m, _ = prepare(model, True)
    graph = PackedGraph(m).eval()
    first, *_ = batches = _check_batches(m)
    args = _inputs(first)
    report = ExportReport(str(path), fmt, m.name, tuple(first.patches.shape), ["sequences", "slots", "images"])
    try:
        if fmt == "onnx":
            program = torch.onnx.export(graph, args, dynamo=True, dynamic_shapes=_dims(m.num_prefix_tokens),
                                        opset_version=opset, input_names=list(PACKED_INPUTS),
                                        output_names=[PACKED_OUTPUT], verbose=False)
        else:
            program = torch.export.export(graph, args, dynamic_shapes=_dims(m.num_prefix_tokens))
    except Exception as e:  # noqa: BLE001 - torch.export and the ONNX exporter raise many kinds
        raise _failed(model, "exporting the packed forward", e) from None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp") if fmt == "onnx" else path.with_suffix(".tmp.pt2")
    run = _save_onnx(program, tmp, m) if fmt == "onnx" else _save_program(program, tmp, m)
    with torch.no_grad():
        for batch in batches:
            want = m.forward_packed(batch).numpy()
            report.checks.append((tuple(batch.patches.shape), float(np.abs(run(*_inputs(batch)) - want).max())))
    return _accept(report, tmp, atol, f"exporting {model.name} on packed batches: the export and forward_packed")


def _save_onnx(program, tmp: Path, m: nn.Module):
    import onnx

    from .onnx_model import OnnxModel

    proto = program.model_proto
    for k, v in packed_metadata(m).items():
        proto.metadata_props.add(key=k, value=v)
    onnx.save(proto, str(tmp))
    try:
        session = OnnxModel(tmp)
    except Exception as e:  # noqa: BLE001
        tmp.unlink(missing_ok=True)
        raise _failed(m, "loading the export in onnxruntime", e) from None
    return lambda *xs: session.run_packed(*(x.numpy() for x in xs))


def _save_program(program, tmp: Path, m: nn.Module):
    from .export import PROGRAM_METADATA

    torch.export.save(program, str(tmp), extra_files={PROGRAM_METADATA: json.dumps(packed_metadata(m))})
    loaded = torch.export.load(str(tmp)).module()
    return lambda *xs: loaded(*xs).numpy()
