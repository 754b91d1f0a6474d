"""The segmenter's head and loss as typed parts. The head is a kind each (``--model.head UperNet
--model.head.channels 256``): ``Linear`` (DINOv2's linear head: a BatchNorm and a 1x1 conv), ``UperNet`` (with
UperNet's auxiliary FCN head on a hierarchical backbone) or ``DPT``, each with the layers it reads (``indices``;
None: ``vitkit.models.segmentation.build_segmenter``'s default). The loss is one dataclass (``--model.loss.dice_weight
0.5``). ``SEGMENTER_FLAT`` names the flat arguments of before them and what each became (``vitkit convert`` upgrades a
checkpoint of them)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from vitkit.errors import UsageError, UsageTypeError
from vitkit.training.flat import Flat, kind_of
from vitkit.training.parts import Part
from vitkit.training.recipe import Recipe


class SegmentationHead(Part):
    """What the segmenter's heads share: the layers the head reads, and the head's name in
    ``vitkit.models.segmentation.HEADS``."""

    name: ClassVar[str] = ""

    def __init__(self, indices: list[int] | None = None) -> None:
        if type(self) is SegmentationHead:
            raise UsageTypeError("head: choose Linear, UperNet or DPT (SegmentationHead is what they share)")
        self.indices = None if indices is None else [int(i) for i in indices]

    def build_args(self) -> dict[str, Any]:
        """What ``build_segmenter`` takes for this head beside its name and indices."""
        return {}


class Linear(SegmentationHead):
    """DINOv2's linear head: the patch tokens of the layers it reads (the last by default), a BatchNorm and a 1x1
    conv."""

    name = "linear"


class UperNet(SegmentationHead):
    """UperNet (a pooling pyramid of ``pool_scales``, lateral convs, a top-down path, fused at ``channels``) on four
    maps, with the auxiliary FCN head on the third (``auxiliary``; None: on a hierarchical backbone, as
    mmsegmentation's UperNet-Swin), ``aux_channels`` wide (its own width, not ``channels``)."""

    name = "upernet"

    def __init__(self, channels: int = 512, pool_scales: Sequence[int] = (1, 2, 3, 6), dropout: float = 0.1,
                 auxiliary: bool | None = None, aux_channels: int = 256, indices: list[int] | None = None) -> None:
        super().__init__(indices)
        self.channels, self.pool_scales, self.dropout = channels, [int(s) for s in pool_scales], dropout
        self.auxiliary, self.aux_channels = auxiliary, aux_channels

    def build_args(self) -> dict[str, Any]:
        return {"channels": self.channels, "pool_scales": tuple(self.pool_scales), "dropout": self.dropout,
                "auxiliary": self.auxiliary, "aux_args": {"channels": self.aux_channels}}


class DPT(SegmentationHead):
    """DPT on four layers of a plain ViT: reassembled to four scales (``reassemble`` widths; None: a quarter to the
    whole of the width), projected to ``channels`` and fused from the coarsest."""

    name = "dpt"

    def __init__(self, channels: int = 256, reassemble: list[int] | None = None, dropout: float = 0.1,
                 indices: list[int] | None = None) -> None:
        super().__init__(indices)
        self.channels, self.dropout = channels, dropout
        self.reassemble = None if reassemble is None else [int(w) for w in reassemble]

    def build_args(self) -> dict[str, Any]:
        return {"channels": self.channels, "reassemble": self.reassemble, "dropout": self.dropout}


@dataclasses.dataclass(frozen=True)
class SegmentationLoss:
    """Cross-entropy over the pixels that count, plus the auxiliary head's at ``aux_weight`` (mmsegmentation's 0.4),
    plus Dice at ``dice_weight`` (0: none)."""

    aux_weight: float = 0.4
    dice_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.aux_weight < 0 or self.dice_weight < 0:
            raise UsageError(f"aux_weight and dice_weight must be >= 0 (0: no such term), got {self.aux_weight} and "
                             f"{self.dice_weight}")


KINDS = {kind.name: kind for kind in (Linear, UperNet, DPT)}
LOSS = SegmentationLoss()


class SegmenterFlat(Flat):
    """The shared translation (recipe, adaptation), and the segmenter's head (``head: upernet`` with its
    ``head_args`` and ``indices``) and loss (``aux_weight``, ``dice_weight``)."""

    def __init__(self, recipe: Recipe) -> None:
        super().__init__(recipe, adaptation=True)
        self.parts = ("recipe", "adaptation", "head", "loss")
        self.names |= {"head_args", "indices", "aux_weight", "dice_weight"}

    def is_flat(self, args: Mapping[str, Any]) -> bool:
        return super().is_flat(args) or _flat_head(args.get("head"))

    def takes_flag(self, key: str | None) -> bool:
        return key in self.names or key == "head"

    def to_parts(self, args: Mapping[str, Any]) -> dict[str, Any]:
        out = super().to_parts({k: v for k, v in args.items() if k != "head" or not _flat_head(v)})
        if _flat_head(args.get("head")) or "head_args" in args or "indices" in args:
            out["head"] = head_of(args).as_config()
        if "aux_weight" in args or "dice_weight" in args:
            out["loss"] = {**dataclasses.asdict(LOSS), **dict(args.get("loss") or {}),
                           **{k: args[k] for k in ("aux_weight", "dice_weight") if k in args}}
        return out

    def flag(self, key: str, value: str) -> tuple[list[str], list[str]]:
        if key == "head":
            kind = KINDS.get(value.strip())
            return ([], [f"--model.{key}", value]) if kind is None else (["--model.head", kind.__name__], [])
        if key in ("aux_weight", "dice_weight"):
            return [], [f"--model.loss.{key}", value]
        if key == "indices":
            return [], ["--model.head.indices", value]
        if key == "head_args":  # each field of the head's kind (choose it first: --model.head UperNet)
            try:
                given = json.loads(value)
            except ValueError:
                given = None
            if not isinstance(given, dict):
                return [], ["--model.head.FIELD", "VALUE"]
            return [], [x for k, v in head_fields(given).items()
                        for x in (f"--model.head.{k}", v if isinstance(v, str) else json.dumps(v))]
        return super().flag(key, value)


def _flat_head(value: Any) -> bool:
    """Whether a ``head`` value is the name of before the parts (``upernet``), not a part (``UperNet``, its dict)."""
    return isinstance(value, str) and value in KINDS


def head_of(args: Mapping[str, Any]) -> SegmentationHead:
    """The head part that flat ``head``, ``head_args`` and ``indices`` describe."""
    name = args.get("head")
    kind = KINDS.get(name) if _flat_head(name) else {k.__name__: k for k in KINDS.values()}.get(
        kind_of(name) or (name if isinstance(name, str) else None) or "Linear")
    if kind is None:
        raise UsageError(f"head must be one of {', '.join(KINDS)}, got {name!r}")
    return kind(**head_fields(args.get("head_args") or {}), indices=args.get("indices"))


def head_fields(head_args: Mapping[str, Any]) -> dict[str, Any]:
    """Flat ``head_args`` as the head part's fields: the auxiliary head's ``aux_args.channels`` is
    ``aux_channels``."""
    given = dict(head_args)
    aux = given.pop("aux_args", None) or {}
    return {**given, **({"aux_channels": aux["channels"]} if "channels" in aux else {})}


SEGMENTER_FLAT = SegmenterFlat(Recipe(lr=1e-3, weight_decay=1e-4, warmup_epochs=1.0))  # Meta's linear heads
