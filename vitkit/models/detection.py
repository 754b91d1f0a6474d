"""Detectors on vitkit backbones, and what every detector gives.

:class:`YOLOS` (Fang et al., 2021, "You Only Look at One Sequence") is the simplest: a plain ViT that reads
``det_tokens`` learned detection tokens appended after its patches, each token's final state read by two MLPs into
class logits (the last one "no object") and a box (centre x, centre y, width, height, relative to the image), with no
anchors and no NMS: a set of predictions matched one-to-one to the objects in training (Hungarian matching, as DETR).
The blocks are the backbone's own, on the one attention core; transformers' ``YolosForObjectDetection`` folders load
into it (``vitkit/checkpoints/detection.py``) and give the same logits and boxes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vitkit.errors import UsageError

from .config import pair
from .dense import OnBackbone


@dataclass
class DetectionOutput:
    """What a detector gives (as transformers' ``*ObjectDetectionOutput``): per query, class logits and a box (B, Q,
    4: centre x, centre y, width, height relative to the input), the same for each earlier layer the training loss
    reads (``aux``), and the loss where the task has computed it.

    The logits are (B, Q, K + 1) for a softmax whose last class is "no object" (DETR, YOLOS), or (B, Q, K) with
    ``sigmoid``, one probability per class (Deformable DETR, RF-DETR). ``groups``: the query groups that each match
    the objects on their own (Group DETR, in training); ``enc``: a two-stage detector's proposals (logits, boxes),
    trained as a layer of their own."""

    logits: Tensor
    boxes: Tensor
    aux: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    loss: Tensor | None = None
    sigmoid: bool = False
    groups: int = 1
    enc: tuple[Tensor, Tensor] | None = None

    def scores(self) -> tuple[Tensor, Tensor]:
        """Per query its likeliest object class and that class's probability: (scores (B, Q), labels (B, Q))."""
        if self.sigmoid:
            return self.logits.float().sigmoid().max(-1)
        return self.logits.float().softmax(-1)[..., :-1].max(-1)


class MLP(nn.Module):
    """``layers`` linear layers with ReLU between them (DETR's box and class heads)."""

    def __init__(self, dim: int, hidden: int, out: int, layers: int) -> None:
        super().__init__()
        widths = [dim] + [hidden] * (layers - 1)
        self.layers = nn.ModuleList(nn.Linear(i, o) for i, o in zip(widths, widths[1:] + [out], strict=True))

    def forward(self, x: Tensor) -> Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x) if i == len(self.layers) - 1 else F.relu(layer(x))
        return x


def resize_grid(pos: Tensor, old: tuple[int, int], new: tuple[int, int]) -> Tensor:
    """Positions (..., h·w, C) of grid ``old`` resized to ``new``: bicubic, corners not aligned, no antialiasing
    (YOLOS's rule, as transformers' code runs it; the same positions at the same grid)."""
    lead, C = pos.shape[:-2], pos.shape[-1]
    grid = pos.reshape(-1, old[0], old[1], C).permute(0, 3, 1, 2)
    grid = F.interpolate(grid.float(), size=new, mode="bicubic", align_corners=False).to(pos.dtype)
    return grid.permute(0, 2, 3, 1).reshape(*lead, new[0] * new[1], C)


class YOLOS(OnBackbone, nn.Module):
    """YOLOS on a vitkit ViT with a class token (built headless: ``num_classes=0``).

    ``det_tokens`` detection tokens with their own positions follow the patches; with ``mid_positions`` every block
    but the last adds a learned position table to its output (YOLOS's "mid position embeddings"). Positions are
    stored at the backbone's ``img_size`` grid and resized to each input's grid, which may be any multiple of the
    patch size. ``forward`` gives a :class:`DetectionOutput`; ``aux`` holds each earlier block's predictions when
    ``aux_outputs`` is set and the model trains (DETR's auxiliary losses; evaluation reads the last block's alone)."""

    task = "detection"  # the task whose commands read its exports

    def __init__(self, backbone: nn.Module, num_classes: int, det_tokens: int = 100, mid_positions: bool = True,
                 aux_outputs: bool = False) -> None:
        super().__init__()
        if getattr(backbone, "cls_token", None) is None or getattr(backbone, "pos_embed", None) is None:
            raise UsageError(f"YOLOS takes a ViT with a class token and learned positions; "
                             f"{getattr(backbone, 'name', type(backbone).__name__)} lacks "
                             f"{'a class token' if getattr(backbone, 'cls_token', None) is None else 'positions'}")
        if getattr(backbone, "num_prefix_tokens", 1) != 1:
            raise UsageError(f"YOLOS reads a class token alone before the patches; "
                             f"{getattr(backbone, 'name', type(backbone).__name__)} has {backbone.num_prefix_tokens} "
                             "prefix tokens")
        self.backbone, self.num_classes, self.aux_outputs = backbone, num_classes, aux_outputs
        C = backbone.cfg.embed_dim
        self.grid = tuple(s // backbone.patch_size for s in pair(backbone.cfg.img_size))
        self.det_token = nn.Parameter(torch.zeros(1, det_tokens, C))
        self.det_pos = nn.Parameter(torch.zeros(1, det_tokens, C))
        depth = len(backbone.blocks)
        length = 1 + self.grid[0] * self.grid[1] + det_tokens
        self.mid_pos = nn.Parameter(torch.zeros(depth - 1, 1, length, C)) if mid_positions and depth > 1 else None
        self.class_head = MLP(C, C, num_classes + 1, 3)
        self.box_head = MLP(C, C, 4, 3)
        nn.init.trunc_normal_(self.det_token, std=0.02)
        nn.init.trunc_normal_(self.det_pos, std=0.02)
        if self.mid_pos is not None:
            nn.init.trunc_normal_(self.mid_pos, std=0.02)

    @property
    def det_tokens(self) -> int:
        return self.det_token.shape[1]

    def no_weight_decay(self) -> set[str]:
        """The backbone's names without weight decay, and the detection tokens and their positions."""
        return super().no_weight_decay() | {"det_token", "det_pos", "mid_pos"}

    def _positions(self, grid: tuple[int, int]) -> tuple[Tensor, Tensor | None]:
        """The input's positions (1, 1 + h·w + N, C) and each block's mid positions (D - 1, 1, L, C) or None."""
        pos = self.backbone.pos_embed
        same = grid == self.grid and not getattr(self.backbone, "dynamic_img_size", False)  # an export of any size
        patches = pos[:, 1:] if same else resize_grid(pos[:, 1:], self.grid, grid)  # resizes in its graph
        first = torch.cat([pos[:, :1], patches, self.det_pos], dim=1)
        if self.mid_pos is None:
            return first, None
        mid = self.mid_pos
        if not same:
            n = self.det_tokens
            mid = torch.cat([mid[:, :, :1], resize_grid(mid[:, :, 1:-n], self.grid, grid), mid[:, :, -n:]], dim=2)
        return first, mid

    def forward(self, x: Tensor) -> DetectionOutput:
        net, p = self.backbone, self.backbone.patch_size
        if x.dim() != 4 or x.shape[-2] % p or x.shape[-1] % p:
            raise UsageError(f"YOLOS takes images (B, C, H, W) whose height and width are multiples of the patch "
                             f"({p} px), got {tuple(x.shape)}")
        tokens = net.patch_embed(x)
        grid = (x.shape[-2] // p, x.shape[-1] // p)
        pos, mid = self._positions(grid)
        B = x.shape[0]
        h = torch.cat([net.cls_token.expand(B, -1, -1), tokens, self.det_token.expand(B, -1, -1)], dim=1) + pos
        h = net.norm_pre(net.pos_drop(h))
        states = []
        for i, blk in enumerate(net.blocks):
            h = blk(h)
            if mid is not None and i < len(net.blocks) - 1:
                h = h + mid[i]
            if self.aux_outputs and self.training and i < len(net.blocks) - 1:
                states.append(h)
        n = self.det_tokens
        logits, boxes = self._heads(net.norm(h)[:, -n:])
        return DetectionOutput(logits, boxes, [self._heads(net.norm(s)[:, -n:]) for s in states])

    def _heads(self, det: Tensor) -> tuple[Tensor, Tensor]:
        return self.class_head(det), self.box_head(det).sigmoid()


def letterbox_size(h: int, w: int, size: int) -> tuple[int, int]:
    """The (height, width) an image of ``h`` x ``w`` is resized to inside a ``size`` letterbox: its longer side
    ``size``, the shorter in proportion (rounded), before the padding at the right and bottom."""
    scale = size / max(h, w)
    return max(1, round(h * scale)), max(1, round(w * scale))


def to_pixels(boxes: Tensor, image: tuple[int, int], size: int) -> Tensor:
    """Corners (M, 4) relative to a ``size`` letterbox -> the image's own pixels (``image``: its height and width),
    clipped to it."""
    h, w = image
    nh, nw = letterbox_size(h, w, size)
    scale = boxes.new_tensor([size * w / nw, size * h / nh, size * w / nw, size * h / nh])
    limit = boxes.new_tensor([w, h, w, h])
    return torch.minimum((boxes * scale).clamp(min=0), limit)


def corners(boxes: Tensor) -> Tensor:
    """(..., 4) centre x, centre y, width, height -> corners."""
    cx, cy, w, h = boxes.unbind(-1)
    return torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], dim=-1)


def detections(out: DetectionOutput, sizes: Tensor, input_size: int, max_detections: int = 100
               ) -> list[dict[str, Tensor]]:
    """Per image, its ``max_detections`` best queries as COCO scores them: ``boxes`` (corners in the image's own
    pixels), ``scores`` and ``labels`` (each query's likeliest class, :meth:`DetectionOutput.scores`, as DETR and
    transformers' ``post_process_object_detection``). ``sizes``: (B, 2) each image's height and width; the input
    (``input_size`` square) is the image letterboxed (:func:`letterbox_size`, padded at the right and bottom)."""
    scores, labels = out.scores()
    xyxy = corners(out.boxes.float())
    result = []
    for i in range(len(xyxy)):
        top = scores[i].argsort(descending=True)[:max_detections]
        boxes = to_pixels(xyxy[i][top], (int(sizes[i][0]), int(sizes[i][1])), input_size)
        result.append({"boxes": boxes, "scores": scores[i][top], "labels": labels[i][top]})
    return result


def truths(targets: list[dict[str, Tensor]], input_size: int) -> list[dict[str, Tensor]]:
    """Targets as batches give them (boxes relative to the ``input_size`` letterbox, ``size``) in the image's own
    pixels, corners, as COCO's evaluation reads them (crowd regions marked)."""
    return [{"boxes": to_pixels(corners(t["boxes"].float()), (int(t["size"][0]), int(t["size"][1])), input_size),
             "labels": t["labels"], "iscrowd": t["iscrowd"].long()} for t in targets]
