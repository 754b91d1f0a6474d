"""RF-DETR (Robinson et al., 2025, "RF-DETR: Neural Architecture Search for Real-Time Detection Transformers") on a
vitkit ViT: LW-DETR's detector (Chen et al., 2024) on a DINOv2 backbone whose blocks attend within windows but for a
few global ones.

The pieces, in the order an image meets them:

- :class:`WindowedViT`: the backbone's patches and positions (resampled bicubic, antialiased) split into
  ``windows`` x ``windows`` windows, each with a copy of the class token; the blocks at ``out_indices`` attend
  across all windows, the others within theirs. The maps are the states *before* those blocks, through the final
  norm, the class tokens dropped (the blocks after the last stage read are not run). The split and its inverse are
  RF-DETR's reshapes, kept as they are: on a grid whose height and width differ they do not tile the image in rows
  of windows, and the trained weights expect that.
- :class:`Projector`: the maps concatenated on channels, a C2f block (YOLOv8's) and a channel LayerNorm: one map of
  ``d_model`` channels at the patch stride.
- Two-stage query selection: every map position proposes a box (its cell, 0.05 wide) refined by a head; the
  ``queries`` best by class score seed the decoder's reference boxes.
- :class:`Decoder`: ``decoder_layers`` layers of query self-attention (on the one attention core), deformable
  cross-attention to the map and an MLP, each followed by LayerNorm, post-norm as DETR. The reference boxes stay
  as the selection gave them; each layer's queries are read by the same class and box heads.
- Class logits are sigmoids (one per class, no "no object"), boxes (centre x, centre y, width, height) relative to
  the input. In training ``groups`` query groups (Group DETR) each match the objects on their own and attend only
  within their group; evaluation keeps the first group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vitkit.errors import UsageError
from vitkit.layers.deformable import DeformableAttention, QuerySelfAttention
from vitkit.layers.pos_embed import rope_rows

from .dense import OnBackbone
from .detection import MLP, DetectionOutput


@dataclass(frozen=True)
class RFDETRConfig:
    """RF-DETR's settings (transformers' ``RfDetrConfig`` defaults, RF-DETR Base's).

    ``out_indices``: the backbone's stages the projector reads (stage k: the state after k blocks).
    ``windows``: windows per side (1: every block global). ``window_blocks``: the blocks that attend within windows,
    the others globally (None: RF-DETR's rule, every block but those whose index is in ``out_indices``). A backbone
    with a class token runs as RF-DETR's windowed DINOv2 (:class:`WindowedViT`), one without as LW-DETR's ViT
    (:class:`WindowedPlainViT`). ``scales``: the projector's levels (1: the patch stride; 0.5 and 2: half and twice
    the resolution, LW-DETR's larger models). ``projector_norm``: ``layer`` (RF-DETR's) or ``batch`` (LW-DETR's)."""

    out_indices: tuple[int, ...] = (2, 5, 8, 11)
    windows: int = 4
    d_model: int = 256
    hidden_expansion: float = 0.5
    c2f_blocks: int = 3
    projector_eps: float = 1e-5
    decoder_layers: int = 3
    self_heads: int = 8
    cross_heads: int = 16
    points: int = 4
    ffn_dim: int = 2048
    queries: int = 300
    groups: int = 13
    dropout: float = 0.1
    window_blocks: tuple[int, ...] | None = None
    scales: tuple[float, ...] = (1.0,)
    projector_norm: str = "layer"

    def __post_init__(self) -> None:
        sizes = {k: getattr(self, k) for k in ("windows", "d_model", "decoder_layers", "queries", "groups", "points",
                                               "self_heads", "cross_heads")}
        small = {k: v for k, v in sizes.items() if v < 1}
        if small or not self.out_indices:
            raise UsageError(f"RF-DETR's sizes must be >= 1 and it reads at least one stage, got "
                             f"{small or {'out_indices': list(self.out_indices)}}")
        if not self.scales or set(self.scales) - {0.5, 1.0, 2.0} or self.projector_norm not in ("layer", "batch"):
            raise UsageError(f"the projector's scales are 0.5, 1 or 2 and its norm layer or batch, got scales "
                             f"{list(self.scales)} and projector_norm {self.projector_norm!r}")
        if self.d_model % self.self_heads or self.d_model % self.cross_heads:
            raise UsageError(f"d_model ({self.d_model}) must be divisible by self_heads ({self.self_heads}) and "
                             f"cross_heads ({self.cross_heads})")


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
    stages, at stride patch x 2^(k-1)), each brought to the grid of the read stage nearest stride 16 (RF-DETR's
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
        self.strides = [net.cfg.patch_size * 2 ** (k - 1) for k in self.out_indices]
        self.widths = [net.cfg.embed_dim * 2 ** (k - 1) for k in self.out_indices]
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


class ConvNorm(nn.Module):
    """A convolution without bias, a norm over channels (LayerNorm, RF-DETR's, or BatchNorm, LW-DETR's) and an
    activation (SiLU, ReLU or none)."""

    def __init__(self, cin: int, cout: int, kernel: int, eps: float, act: str = "silu", norm: str = "layer",
                 stride: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel, stride, padding=kernel // 2, bias=False)
        self.channels_last = norm == "layer"
        self.norm = nn.LayerNorm(cout, eps=eps) if self.channels_last else nn.BatchNorm2d(cout, eps=eps)
        self.act = {"silu": nn.SiLU(), "relu": nn.ReLU(), "": nn.Identity()}[act]

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv(x)
        x = self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2) if self.channels_last else self.norm(x)
        return self.act(x)


class Bottleneck(nn.Module):
    """Two 3x3 ConvNorms (RF-DETR's RepVGG block, without a shortcut)."""

    def __init__(self, width: int, eps: float, norm: str = "layer") -> None:
        super().__init__()
        self.conv1, self.conv2 = ConvNorm(width, width, 3, eps, norm=norm), ConvNorm(width, width, 3, eps, norm=norm)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv2(self.conv1(x))


def _sampler(width: int, scale: float, eps: float, norm: str) -> nn.Module:
    """One map brought to a level's scale: 2x by a transposed conv (to half the channels; a quarter, through a 1x1
    ConvNorm first, above 512), 1/2 by a strided 3x3 ConvNorm with ReLU (LW-DETR's)."""
    if scale == 2.0:
        if width > 512:
            return nn.Sequential(ConvNorm(width, width // 2, 1, eps, "relu", norm),
                                 nn.ConvTranspose2d(width // 2, width // 4, 2, stride=2))
        return nn.Sequential(nn.ConvTranspose2d(width, width // 2, 2, stride=2))
    if scale == 0.5:
        return nn.Sequential(ConvNorm(width, width, 3, eps, "relu", norm, stride=2))
    return nn.Sequential()


class Projector(nn.Module):
    """One level: the maps (B, C, h, w) each brought to ``scale`` (``samplers``), concatenated -> C2f (a 1x1 split
    in two halves, bottlenecks on the second, every output concatenated, a 1x1) -> a channel LayerNorm:
    (B, d_model, h·scale, w·scale)."""

    def __init__(self, widths: list[int], cfg: RFDETRConfig, scale: float = 1.0) -> None:
        super().__init__()
        eps, norm = cfg.projector_eps, cfg.projector_norm
        self.hidden = int(cfg.d_model * cfg.hidden_expansion)
        self.samplers = nn.ModuleList(_sampler(c, scale, eps, norm) for c in widths)
        cin = sum(c // (2 if c <= 512 else 4) if scale == 2.0 else c for c in widths)
        self.conv1 = ConvNorm(cin, 2 * self.hidden, 1, eps, norm=norm)
        self.bottlenecks = nn.ModuleList(Bottleneck(self.hidden, eps, norm) for _ in range(cfg.c2f_blocks))
        self.conv2 = ConvNorm((2 + cfg.c2f_blocks) * self.hidden, cfg.d_model, 1, eps, norm=norm)
        self.norm = nn.LayerNorm(cfg.d_model, eps=1e-6)

    def forward(self, maps: list[Tensor]) -> Tensor:
        maps = [sample(m) for sample, m in zip(self.samplers, maps, strict=True)]
        parts = list(self.conv1(torch.cat(maps, dim=1)).split(self.hidden, dim=1))
        x = parts[-1]
        for block in self.bottlenecks:
            x = block(x)
            parts.append(x)
        x = self.conv2(torch.cat(parts, dim=1))
        return self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def _one_level_projector(state_dict: dict, prefix: str, *args) -> None:
    """A state dict of RF-DETR with one projector (``projector.conv1...``, before the levels) in today's names
    (``projector.0.conv1...``)."""
    old = prefix + "projector."
    for k in [k for k in state_dict if k.startswith(old) and not k[len(old):].split(".")[0].isdigit()]:
        state_dict[old + "0." + k[len(old):]] = state_dict.pop(k)


def sine_embedding(boxes: Tensor, width: int, temperature: float = 10000.0) -> Tensor:
    """Boxes (..., 4) in [0, 1] -> (..., 4·width): each coordinate's sines and cosines interleaved, y's before x's
    (DETR's order), then width and height."""
    dim_t = torch.arange(width, dtype=torch.float32, device=boxes.device)
    dim_t = temperature ** (2 * torch.div(dim_t, 2, rounding_mode="floor") / width)
    parts = [(c[..., None] * 2 * math.pi / dim_t) for c in boxes.unbind(-1)]
    parts = [torch.stack((e[..., 0::2].sin(), e[..., 1::2].cos()), dim=-1).flatten(-2) for e in parts]
    parts[0], parts[1] = parts[1], parts[0]
    return torch.cat(parts, dim=-1).to(boxes.dtype)


def refine(boxes: Tensor, deltas: Tensor) -> Tensor:
    """Boxes (cx, cy, w, h) moved by ``deltas``: the centre by the deltas times the size, the size scaled by their
    exponential."""
    return torch.cat([deltas[..., :2] * boxes[..., 2:] + boxes[..., :2], deltas[..., 2:].exp() * boxes[..., 2:]], -1)


class DecoderLayer(nn.Module):
    """Query self-attention, deformable cross-attention to the map and an MLP, each added and LayerNormed."""

    def __init__(self, cfg: RFDETRConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.self_attn = QuerySelfAttention(d, cfg.self_heads)
        self.self_attn_norm = nn.LayerNorm(d)
        self.cross_attn = DeformableAttention(d, cfg.cross_heads, levels=len(cfg.scales), points=cfg.points)
        self.cross_attn_norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, cfg.ffn_dim), nn.Linear(cfg.ffn_dim, d)
        self.norm = nn.LayerNorm(d)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor, pos: Tensor, reference: Tensor, memory: Tensor, shapes: list[tuple[int, int]],
                groups: int) -> Tensor:
        B, N, C = x.shape
        grouped = (B, groups, N // groups, C)  # Group DETR: each group attends within itself
        attn = self.self_attn(x.reshape(grouped), pos.reshape(grouped)).reshape(B, N, C)
        x = self.self_attn_norm(x + self.drop(attn))
        x = self.cross_attn_norm(x + self.drop(self.cross_attn(x + pos, reference, memory, shapes)))
        return self.norm(x + self.drop(self.fc2(self.drop(F.relu(self.fc1(x))))))


class RFDETR(OnBackbone, nn.Module):
    """RF-DETR (module docstring) on a vitkit ViT built headless: ``forward`` gives a :class:`DetectionOutput`
    whose logits are sigmoids (``sigmoid``), with the two-stage proposals (``enc``) when it trains, and each earlier
    layer's predictions (``aux``) too where ``aux_outputs``."""

    task = "detection"

    def __init__(self, backbone: nn.Module, num_classes: int, cfg: RFDETRConfig | None = None,
                 aux_outputs: bool = True) -> None:
        super().__init__()
        cfg = cfg or RFDETRConfig()
        self.cfg, self.num_classes, self.aux_outputs = cfg, num_classes, aux_outputs
        self.backbone = backbone
        staged = hasattr(backbone, "layers") and not hasattr(backbone, "blocks")  # stages of their own: Swin
        plain = getattr(backbone, "num_prefix_tokens", 1) == 0  # no class token: LW-DETR's ViT
        if staged:
            self.windowed = StagedMaps(backbone, cfg.out_indices, cfg.window_blocks)
        else:
            self.windowed = WindowedPlainViT(backbone, cfg.out_indices, cfg.windows, cfg.window_blocks) if plain \
                else WindowedViT(backbone, cfg.out_indices, cfg.windows, cfg.window_blocks)
        for blk in (backbone.layers if staged else backbone.blocks)[max(cfg.out_indices):]:  # never run (no stage
            blk.requires_grad_(False)  # reads them): kept for the files' keys, out of the optimizer and DDP's reduction
        unused = ["attn_pool", "fc_norm", "head"] + (["norm"] if plain or staged else [])  # LW-DETR reads the states
        for name in unused:  # as they are; no detector pools: never run, so out of the optimizer and DDP's reduction
            part = getattr(backbone, name, None)
            if isinstance(part, nn.Module):
                part.requires_grad_(False)
        widths = self.windowed.widths if staged else [backbone.cfg.embed_dim] * len(cfg.out_indices)
        self.projector = nn.ModuleList(Projector(widths, cfg, scale) for scale in cfg.scales)
        self._register_load_state_dict_pre_hook(_one_level_projector)
        d, G, Q = cfg.d_model, cfg.groups, cfg.queries
        self.reference_embed = nn.Parameter(torch.zeros(Q * G, 4))
        self.query_feat = nn.Parameter(torch.zeros(Q * G, d))
        nn.init.normal_(self.query_feat)
        self.enc_output = nn.ModuleList(nn.Linear(d, d) for _ in range(G))
        self.enc_output_norm = nn.ModuleList(nn.LayerNorm(d) for _ in range(G))
        self.enc_class = nn.ModuleList(nn.Linear(d, num_classes) for _ in range(G))
        self.enc_box = nn.ModuleList(MLP(d, d, 4, 3) for _ in range(G))
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.decoder_layers))
        self.decoder_norm = nn.LayerNorm(d)
        self.ref_point_head = MLP(2 * d, d, d, 2)
        self.class_head = nn.Linear(d, num_classes)
        self.box_head = MLP(d, d, 4, 3)
        self._class_prior()
        for box in [self.box_head, *self.enc_box]:
            nn.init.zeros_(box.layers[-1].weight)
            nn.init.zeros_(box.layers[-1].bias)

    def reset_classes(self, num_classes: int) -> None:
        """New class heads (the decoder's and every group's proposals') for ``num_classes``, each class at a 1 %
        prior (focal loss's start): a trained detector fine-tuned on other classes keeps everything else."""
        d, G = self.cfg.d_model, self.cfg.groups
        self.num_classes = num_classes
        self.class_head = nn.Linear(d, num_classes)
        self.enc_class = nn.ModuleList(nn.Linear(d, num_classes) for _ in range(G))
        self._class_prior()

    def _class_prior(self) -> None:
        prior = -math.log((1 - 0.01) / 0.01)  # a 1 % prior for every class (focal loss's start)
        for head in [self.class_head, *self.enc_class]:
            nn.init.constant_(head.bias, prior)

    @property
    def img_multiple(self) -> int:
        """Inputs' height and width are multiples of this (the patch times the windows per side; a Swin's stride at
        its last read stage)."""
        if isinstance(self.windowed, StagedMaps):
            return self.windowed.multiple
        return self.backbone.patch_size * self.cfg.windows

    @property
    def map_stride(self) -> int:
        """The pixels per position of the maps the decoder reads at scale 1."""
        return self.windowed.stride if isinstance(self.windowed, StagedMaps) else self.backbone.patch_size

    def size_rule(self) -> str:
        """Why the sides are multiples of :attr:`img_multiple`, in words."""
        if isinstance(self.windowed, StagedMaps):
            return self.windowed.rule()
        return f"the {self.backbone.patch_size} px patch x {self.cfg.windows} windows"

    def no_weight_decay(self) -> set[str]:
        return super().no_weight_decay() | {"reference_embed", "query_feat"}

    def _proposals(self, memory: Tensor, shapes: list[tuple[int, int]]) -> tuple[Tensor, Tensor]:
        """Every map position's proposal (B, S, 4): its cell's centre, 0.05 wide and high at the first level (twice
        that at the next, ...); and (B, S, 1) True where a proposal is not strictly inside (0.01, 0.99), as RF-DETR
        drops them."""
        levels = []
        for level, (h, w) in enumerate(shapes):
            y, x = torch.meshgrid(torch.arange(h, dtype=memory.dtype, device=memory.device),
                                  torch.arange(w, dtype=memory.dtype, device=memory.device), indexing="ij")
            centre = (torch.stack([x, y], -1) + 0.5) / torch.tensor([w, h], dtype=memory.dtype, device=memory.device)
            levels.append(torch.cat([centre, torch.full_like(centre, 0.05 * 2.0 ** level)], -1).view(1, h * w, 4))
        boxes = torch.cat(levels, 1).expand(memory.shape[0], -1, -1)  # (B, S, 4); the batch stays symbolic
        invalid = ~((boxes > 0.01) & (boxes < 0.99)).all(-1, keepdim=True)
        return boxes.masked_fill(invalid, 0.0), invalid

    def _select(self, g: int, memory: Tensor, proposals: Tensor, invalid: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Group ``g``'s two-stage selection: (its queries' features (B, Q, d), their boxes (B, Q, 4), and those
        boxes detached) of the ``queries`` best-scored proposals."""
        q = self.enc_output_norm[g](self.enc_output[g](memory))  # (B, S, d)
        scores = self.enc_class[g](q).masked_fill(invalid, float("-inf")).max(-1)[0]
        boxes = refine(proposals, self.enc_box[g](q))
        top = scores.topk(self.cfg.queries, dim=1)[1]  # (B, Q)
        chosen = boxes.gather(1, top[..., None].expand(-1, -1, 4))
        return q.gather(1, top[..., None].expand(-1, -1, q.shape[-1])), chosen, chosen.detach()

    def forward(self, x: Tensor) -> DetectionOutput:
        features = self.windowed(self.backbone, x)
        mapped = [level(features) for level in self.projector]  # (B, d, h_l, w_l) per level
        (B, d), shapes = mapped[0].shape[:2], [tuple(m.shape[-2:]) for m in mapped]
        positions = sum(h * w for h, w in shapes)
        if not torch.compiler.is_compiling() and positions < self.cfg.queries:
            raise UsageError(f"RF-DETR selects {self.cfg.queries} queries from the maps' {positions} positions "
                             f"({' + '.join(f'{h} x {w}' for h, w in shapes)}): give a larger image or fewer queries")
        memory = torch.cat([m.flatten(2).transpose(1, 2) for m in mapped], 1)  # (B, S, d)
        proposals, invalid = self._proposals(memory, shapes)
        memory_q = memory.masked_fill(invalid, 0.0)
        groups = self.cfg.groups if self.training else 1
        selected = [self._select(g, memory_q, proposals, invalid) for g in range(groups)]
        Q = self.cfg.queries * groups
        reference = refine(torch.cat([s[2] for s in selected], 1), self.reference_embed[:Q].expand(B, -1, -1))
        pos = self.ref_point_head(sine_embedding(reference, d // 2))  # (B, Q, d)
        states, query = [], self.query_feat[:Q].expand(B, -1, -1)
        for layer in self.layers:
            query = layer(query, pos, reference[:, :, None].expand(-1, -1, len(shapes), -1), memory, shapes, groups)
            states.append(self.decoder_norm(query))
        logits, boxes = self._heads(states[-1], reference)
        out = DetectionOutput(logits, boxes, sigmoid=True, groups=groups)
        if self.training:
            out.aux = [self._heads(s, reference) for s in states[:-1]] if self.aux_outputs else []
            out.enc = (torch.cat([self.enc_class[g](s[0]) for g, s in enumerate(selected)], 1),
                       torch.cat([s[1] for s in selected], 1))
        return out

    def _heads(self, state: Tensor, reference: Tensor) -> tuple[Tensor, Tensor]:
        return self.class_head(state), refine(reference, self.box_head(state))
