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

from .dense import OnBackbone, is_hierarchical
from .detection import MLP, DetectionOutput
from .detr_backbones import StagedMaps, WindowedPlainViT, WindowedViT


@dataclass(frozen=True)
class RFDETRConfig:
    """RF-DETR's settings (transformers' ``RfDetrConfig`` defaults, RF-DETR Base's).

    ``out_indices``: the backbone's stages the projector reads (stage k: the state after k blocks).
    ``windows``: windows per side (1: every block global). ``window_blocks``: the blocks that attend within windows,
    the others globally (None: RF-DETR's rule, every block but those whose index is in ``out_indices``). A backbone
    with a class token runs as RF-DETR's windowed DINOv2 (:class:`WindowedViT`), one without as LW-DETR's ViT
    (:class:`WindowedPlainViT`). ``scales``: the projector's levels (1: the patch stride; 0.5 and 2: half and twice
    the resolution, LW-DETR's larger models and RF-DETR's P3 and P5). ``projector_norm``: ``layer`` (RF-DETR's) or
    ``batch`` (LW-DETR's). ``reduce_wide``: a map wider than 512 brought to twice the resolution goes through a 1x1
    ConvNorm to half its width first (LW-DETR's; RF-DETR's own projector does not)."""

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
    reduce_wide: bool = True

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


def _sampler(width: int, scale: float, eps: float, norm: str, reduce_wide: bool = True) -> nn.Module:
    """One map brought to a level's scale: 2x by a transposed conv (to half the channels; a quarter, through a 1x1
    ConvNorm first, above 512 where ``reduce_wide``), 1/2 by a strided 3x3 ConvNorm with ReLU."""
    if scale == 2.0:
        if width > 512 and reduce_wide:
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
        self.samplers = nn.ModuleList(_sampler(c, scale, eps, norm, cfg.reduce_wide) for c in widths)
        cin = sum(c // (4 if c > 512 and cfg.reduce_wide else 2) if scale == 2.0 else c for c in widths)
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
        staged = is_hierarchical(backbone)  # stages of their own: Swin
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
