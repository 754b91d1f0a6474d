"""The set loss of DETR-style detectors (Carion et al., 2020), which YOLOS trains with: each image's objects are
matched one-to-one to its queries by the Hungarian algorithm on a cost of class probability, L1 box distance and
generalised IoU; matched queries learn their object's class and box, the others "no object" (down-weighted by
``eos_coef``). Boxes are (centre x, centre y, width, height) relative to the image; the box terms are summed over the
objects and divided by their count (over every rank, where a process group is up). With ``aux`` outputs (each
earlier layer's predictions) each adds the same terms, matched on its own.

Detectors whose classes are sigmoids (``DetectionOutput.sigmoid``: RF-DETR, LW-DETR) are matched on the focal cost
(Deformable DETR's) and learn their classes by LW-DETR's IoU-aware BCE: a matched query's target for its class is
a blend of its probability and its box's IoU with the object's, every other class and query pushed to zero with a
focal weight; the sum is divided by the object count. Their query groups (Group DETR) are matched each on its own
and the count is multiplied by the groups; their two-stage proposals (``enc``) add the same terms as ``*_enc``.
With equal weights the total equals transformers' ``LwDetrForObjectDetectionLoss``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from scipy.optimize import linear_sum_assignment
from torch import Tensor
from torchvision.ops import box_convert, box_iou, generalized_box_iou

from vitkit.errors import UsageError
from vitkit.models.detection import DetectionOutput


def _xyxy(boxes: Tensor) -> Tensor:
    return box_convert(boxes, "cxcywh", "xyxy")


@dataclass(frozen=True)
class SetLoss:
    """The set loss's weights, DETR's and YOLOS's by default.

    The matching cost weighs ``class_cost`` (None: DETR's 1 for a softmax, LW-DETR's 2 for sigmoids),
    ``bbox_cost`` and ``giou_cost``; the loss ``class_weight``, ``l1_weight`` and ``giou_weight``; ``eos_coef`` is
    the weight of the "no object" class in a softmax's class term, ``focal_alpha`` the focal balance of sigmoids'."""

    class_cost: float | None = None
    bbox_cost: float = 5.0
    giou_cost: float = 2.0
    class_weight: float = 1.0
    l1_weight: float = 5.0
    giou_weight: float = 2.0
    eos_coef: float = 0.1
    focal_alpha: float = 0.25

    def __post_init__(self) -> None:
        class_cost = 1.0 if self.class_cost is None else self.class_cost
        if min(class_cost, self.focal_alpha, self.bbox_cost, self.giou_cost, self.class_weight, self.l1_weight,
               self.giou_weight, self.eos_coef) < 0:
            raise UsageError(f"the set loss's costs and weights must be >= 0, got {self}")

    def _class_cost(self, logits: Tensor, labels: Tensor, sigmoid: bool) -> Tensor:
        """(Q, M): minus the softmax probability of each object's class, or the focal cost of its sigmoid."""
        if not sigmoid:
            return -(1.0 if self.class_cost is None else self.class_cost) * logits.float().softmax(-1)[:, labels]
        p, a = logits.float().sigmoid()[:, labels], 0.25  # the matcher's alpha is fixed (LW-DETR's)
        pos = a * (1 - p) ** 2 * -(p + 1e-8).log()
        neg = (1 - a) * p**2 * -(1 - p + 1e-8).log()
        return (2.0 if self.class_cost is None else self.class_cost) * (pos - neg)

    @torch.no_grad()
    def match(self, logits: Tensor, boxes: Tensor, targets: list[dict[str, Tensor]], sigmoid: bool = False,
              groups: int = 1) -> list[tuple[Tensor, Tensor]]:
        """Per image, (the matched queries, their objects' indices), from the Hungarian algorithm on the cost; each
        of ``groups`` query groups matched on its own."""
        out = []
        size = logits.shape[1] // groups
        for b, t in enumerate(targets):
            labels, tboxes = t["labels"], t["boxes"]
            if len(labels) == 0:
                out.append((labels.new_zeros(0), labels.new_zeros(0)))
                continue
            cost = (self.bbox_cost * torch.cdist(boxes[b].float(), tboxes.float(), p=1)
                    + self._class_cost(logits[b], labels, sigmoid)
                    - self.giou_cost * generalized_box_iou(_xyxy(boxes[b].float()), _xyxy(tboxes.float())))
            cost = torch.nan_to_num(cost, nan=torch.finfo(cost.dtype).max, posinf=torch.finfo(cost.dtype).max,
                                    neginf=torch.finfo(cost.dtype).max).cpu().numpy()
            rows, cols = [], []
            for g in range(groups):
                r, c = linear_sum_assignment(cost[g * size:(g + 1) * size])
                rows.append(torch.as_tensor(r, dtype=torch.long) + g * size)
                cols.append(torch.as_tensor(c, dtype=torch.long))
            out.append((torch.cat(rows), torch.cat(cols)))
        return out

    def _sigmoid_classes(self, logits: Tensor, batch: Tensor, query: Tensor, classes: Tensor, iou: Tensor,
                         num_boxes: float) -> Tensor:
        """LW-DETR's IoU-aware BCE (module docstring)."""
        logits = logits.float()
        prob = logits.sigmoid()
        pos_w = torch.zeros_like(logits)
        neg_w = prob.pow(2)
        a = self.focal_alpha
        quality = (prob[batch, query, classes].pow(a) * iou.pow(1 - a)).clamp(min=0.01).detach()
        pos_w[batch, query, classes] = quality
        neg_w = neg_w.index_put((batch, query, classes), 1 - quality)
        loss = -pos_w * F.logsigmoid(logits) - neg_w * F.logsigmoid(-logits)
        return loss.sum() / num_boxes

    def terms(self, logits: Tensor, boxes: Tensor, targets: list[dict[str, Tensor]], num_boxes: float,
              sigmoid: bool = False, groups: int = 1) -> dict[str, Tensor]:
        """The class, L1 and GIoU terms of one layer's predictions."""
        matched = self.match(logits, boxes, targets, sigmoid, groups)
        batch = torch.cat([torch.full_like(q, b) for b, (q, _) in enumerate(matched)]).to(logits.device)
        query = torch.cat([q for q, _ in matched]).to(logits.device)
        labels = torch.cat([t["labels"][o] for t, (_, o) in zip(targets, matched, strict=True)]).to(logits.device)
        src = boxes[batch, query].float()
        tgt = torch.cat([t["boxes"][o] for t, (_, o) in zip(targets, matched, strict=True)]).to(src)
        if sigmoid:
            iou = torch.diag(box_iou(_xyxy(src.detach()), _xyxy(tgt))) if len(src) else src.new_zeros(0)
            ce = self._sigmoid_classes(logits, batch, query, labels, iou, num_boxes)
        else:
            K = logits.shape[-1] - 1
            classes = torch.full(logits.shape[:2], K, dtype=torch.long, device=logits.device)
            classes[batch, query] = labels
            weight = torch.ones(K + 1, device=logits.device)
            weight[K] = self.eos_coef
            ce = F.cross_entropy(logits.float().transpose(1, 2), classes, weight)
        l1 = F.l1_loss(src, tgt, reduction="sum") / num_boxes
        giou = (1 - torch.diag(generalized_box_iou(_xyxy(src), _xyxy(tgt)))).sum() / num_boxes
        return {"class": ce, "l1": l1, "giou": giou}

    def __call__(self, out: DetectionOutput, targets: list[dict[str, Tensor]]) -> tuple[Tensor, dict[str, Tensor]]:
        """(the weighted total, each term: ``class``, ``l1``, ``giou`` and each auxiliary layer's ``*_i``).
        ``targets``: per image ``labels`` (M,) class indices and ``boxes`` (M, 4) cxcywh in [0, 1]."""
        if len(targets) != out.logits.shape[0]:
            raise UsageError(f"the set loss takes one target per image: {out.logits.shape[0]} images, "
                             f"{len(targets)} targets")
        classes = out.logits.shape[-1] - (0 if out.sigmoid else 1)
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
        num_boxes = float((num * out.groups).clamp(min=1))
        kind = dict(sigmoid=out.sigmoid, groups=out.groups)
        parts = self.terms(out.logits, out.boxes, targets, num_boxes, **kind)
        for i, (logits, boxes) in enumerate(out.aux):
            parts.update({f"{k}_{i}": v for k, v in self.terms(logits, boxes, targets, num_boxes, **kind).items()})
        if out.enc is not None:
            parts.update({f"{k}_enc": v for k, v in self.terms(*out.enc, targets, num_boxes, **kind).items()})
        weights = {"class": self.class_weight, "l1": self.l1_weight, "giou": self.giou_weight}
        total = sum(v * weights[k.split("_")[0]] for k, v in parts.items())
        out.loss = total
        return total, parts
