"""The set loss of DETR-style detectors (Carion et al., 2020), which YOLOS trains with: each image's objects are
matched one-to-one to its queries by the Hungarian algorithm on a cost of class probability, L1 box distance and
generalised IoU; matched queries learn their object's class and box, the others "no object" (down-weighted by
``eos_coef``). Boxes are (centre x, centre y, width, height) relative to the image; the box terms are summed over the
objects and divided by their count (over every rank, where a process group is up). With ``aux`` outputs (each
earlier layer's predictions) each adds the same terms, matched on its own."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from scipy.optimize import linear_sum_assignment
from torch import Tensor
from torchvision.ops import box_convert, generalized_box_iou

from vitkit.errors import UsageError
from vitkit.models.detection import DetectionOutput


def _xyxy(boxes: Tensor) -> Tensor:
    return box_convert(boxes, "cxcywh", "xyxy")


@dataclass(frozen=True)
class SetLoss:
    """The set loss's weights, DETR's and YOLOS's by default.

    The matching cost weighs ``class_cost``, ``bbox_cost`` and ``giou_cost``; the loss ``class_weight``,
    ``l1_weight`` and ``giou_weight``; ``eos_coef`` is the weight of the "no object" class in the class term."""

    class_cost: float = 1.0
    bbox_cost: float = 5.0
    giou_cost: float = 2.0
    class_weight: float = 1.0
    l1_weight: float = 5.0
    giou_weight: float = 2.0
    eos_coef: float = 0.1

    def __post_init__(self) -> None:
        if min(self.class_cost, self.bbox_cost, self.giou_cost, self.class_weight, self.l1_weight, self.giou_weight,
               self.eos_coef) < 0:
            raise UsageError(f"the set loss's costs and weights must be >= 0, got {self}")

    @torch.no_grad()
    def match(self, logits: Tensor, boxes: Tensor, targets: list[dict[str, Tensor]]) -> list[tuple[Tensor, Tensor]]:
        """Per image, (the matched queries, their objects' indices), from the Hungarian algorithm on the cost."""
        out = []
        for b, t in enumerate(targets):
            labels, tboxes = t["labels"], t["boxes"]
            if len(labels) == 0:
                out.append((labels.new_zeros(0), labels.new_zeros(0)))
                continue
            prob = logits[b].float().softmax(-1)
            cost = (self.bbox_cost * torch.cdist(boxes[b].float(), tboxes.float(), p=1)
                    - self.class_cost * prob[:, labels]
                    - self.giou_cost * generalized_box_iou(_xyxy(boxes[b].float()), _xyxy(tboxes.float())))
            rows, cols = linear_sum_assignment(cost.cpu().numpy())
            out.append((torch.as_tensor(rows, dtype=torch.long), torch.as_tensor(cols, dtype=torch.long)))
        return out

    def terms(self, logits: Tensor, boxes: Tensor, targets: list[dict[str, Tensor]],
              num_boxes: float) -> dict[str, Tensor]:
        """The class, L1 and GIoU terms of one layer's predictions."""
        K = logits.shape[-1] - 1
        matched = self.match(logits, boxes, targets)
        batch = torch.cat([torch.full_like(q, b) for b, (q, _) in enumerate(matched)]).to(logits.device)
        query = torch.cat([q for q, _ in matched]).to(logits.device)
        classes = torch.full(logits.shape[:2], K, dtype=torch.long, device=logits.device)
        classes[batch, query] = torch.cat([t["labels"][o] for t, (_, o) in zip(targets, matched, strict=True)]).to(
            logits.device)
        weight = torch.ones(K + 1, device=logits.device)
        weight[K] = self.eos_coef
        ce = F.cross_entropy(logits.float().transpose(1, 2), classes, weight)
        src = boxes[batch, query].float()
        tgt = torch.cat([t["boxes"][o] for t, (_, o) in zip(targets, matched, strict=True)]).to(src)
        l1 = F.l1_loss(src, tgt, reduction="sum") / num_boxes
        giou = (1 - torch.diag(generalized_box_iou(_xyxy(src), _xyxy(tgt)))).sum() / num_boxes
        return {"class": ce, "l1": l1, "giou": giou}

    def __call__(self, out: DetectionOutput, targets: list[dict[str, Tensor]]) -> tuple[Tensor, dict[str, Tensor]]:
        """(the weighted total, each term: ``class``, ``l1``, ``giou`` and each auxiliary layer's ``*_i``).
        ``targets``: per image ``labels`` (M,) class indices and ``boxes`` (M, 4) cxcywh in [0, 1]."""
        if len(targets) != out.logits.shape[0]:
            raise UsageError(f"the set loss takes one target per image: {out.logits.shape[0]} images, "
                             f"{len(targets)} targets")
        classes = out.logits.shape[-1] - 1
        for i, t in enumerate(targets):
            labels, boxes = t.get("labels"), t.get("boxes")
            if labels is None or boxes is None or boxes.dim() != 2 or boxes.shape[-1] != 4 or len(boxes) != len(labels):
                raise UsageError(f"target {i}: expected labels (M,) and boxes (M, 4), got labels "
                                 f"{None if labels is None else tuple(labels.shape)} and boxes "
                                 f"{None if boxes is None else tuple(boxes.shape)}")
            if len(labels) and (labels.min() < 0 or labels.max() >= classes):
                raise UsageError(f"target {i}: labels must be classes 0 to {classes - 1} (the detector's), got "
                                 f"{labels.min().item()} to {labels.max().item()}")
            if len(boxes) and (boxes.min() < 0 or boxes.max() > 1):
                raise UsageError(f"target {i}: boxes must be centre x, centre y, width, height relative to the image "
                                 f"(0 to 1; vitkit.data.detection.normalised_targets gives them), got values from "
                                 f"{boxes.min().item():.3g} to {boxes.max().item():.3g}")
        num = torch.tensor(float(sum(len(t["labels"]) for t in targets)), device=out.logits.device)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(num)
            num = num / torch.distributed.get_world_size()
        num_boxes = float(num.clamp(min=1))
        parts = self.terms(out.logits, out.boxes, targets, num_boxes)
        for i, (logits, boxes) in enumerate(out.aux):
            parts.update({f"{k}_{i}": v for k, v in self.terms(logits, boxes, targets, num_boxes).items()})
        weights = {"class": self.class_weight, "l1": self.l1_weight, "giou": self.giou_weight}
        total = sum(v * weights[k.split("_")[0]] for k, v in parts.items())
        out.loss = total
        return total, parts
