"""DINO's settings as typed parts, each a dataclass the command line and a config file fill field by field
(``--model.head.out_dim 1024``, ``--model.loss.teacher_temp 0.04``, ``--model.crops.local_crops 2``), stored as plain
values in a checkpoint, as the recipe is. ``DINO_FLAT`` names the flat arguments of before them and what each became
(``vitkit convert`` upgrades a checkpoint of them)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

from vitkit.errors import UsageError
from vitkit.training.flat import Flat
from vitkit.training.recipe import Recipe


@dataclasses.dataclass(frozen=True)
class Heads:
    """The DINO and iBOT projection heads (``vitkit.models.dino.DINOConfig``): an MLP of ``layers`` layers
    (``hidden_dim`` wide) to a ``bottleneck_dim`` bottleneck, normalised, then ``out_dim`` prototypes (DINOv2's
    65,536), the last layer's norm fixed with ``norm_last_layer``; iBOT's own prototypes with ``ibot_out_dim`` (None:
    DINO's head serves both)."""

    out_dim: int = 65536
    hidden_dim: int = 2048
    bottleneck_dim: int = 256
    layers: int = 3
    norm_last_layer: bool = True
    ibot_out_dim: int | None = None


@dataclasses.dataclass(frozen=True)
class Losses:
    """DINO's, iBOT's and KoLeo's losses: the temperatures (the teacher's rises linearly from
    ``warmup_teacher_temp`` over ``warmup_teacher_temp_epochs``), the teacher's centering (``mean`` with
    ``center_momentum``, or ``sinkhorn``), each loss's weight, and iBOT's masking (a share in ``mask_ratio`` of the
    patches of ``mask_probability`` of the global crops)."""

    student_temp: float = 0.1
    teacher_temp: float = 0.07
    warmup_teacher_temp: float = 0.04
    warmup_teacher_temp_epochs: float = 30.0
    center_momentum: float = 0.9
    centering: Literal["mean", "sinkhorn"] = "mean"
    dino_weight: float = 1.0
    ibot_weight: float = 1.0
    koleo_weight: float = 0.1
    mask_ratio: tuple[float, float] = (0.1, 0.5)
    mask_probability: float = 0.5

    def __post_init__(self) -> None:
        if min(self.teacher_temp, self.warmup_teacher_temp) <= 0:
            raise UsageError(f"the teacher's temperatures must be > 0, got teacher_temp={self.teacher_temp}, "
                             f"warmup_teacher_temp={self.warmup_teacher_temp}")


@dataclasses.dataclass(frozen=True)
class Crops:
    """The multi-crop (``vitkit.data.multicrop.MultiCrop``): how many global and local crops, their sizes (None:
    the images' and 3/7 of it, rounded to the patch size) and scales, and the probabilities of its colour operations
    (0 turns one off, as for grey digits, where colour carries nothing)."""

    global_crops: int = 2
    local_crops: int = 8
    global_size: int | None = None
    local_size: int | None = None
    global_scale: tuple[float, float] = (0.32, 1.0)
    local_scale: tuple[float, float] = (0.05, 0.32)
    jitter: float = 0.8
    grey: float = 0.2
    blur: tuple[float, float, float] = (1.0, 0.1, 0.5)
    solarize: float = 0.2


HEADS, LOSSES, CROPS = Heads(), Losses(), Crops()  # the defaults (DINOv2's)
PARTS: dict[str, type] = {"head": Heads, "loss": Losses, "crops": Crops}  # the argument each is given as
RENAMED = {"head_layers": ("head", "layers")}  # a flat argument whose field is named otherwise
FIELDS = {**{f.name: (part, f.name) for part, cls in PARTS.items() for f in dataclasses.fields(cls)}, **RENAMED}
FIELDS.pop("layers")


def part_of(value: Any, cls: type) -> Any:
    """A part from its dataclass or its fields as a checkpoint keeps them."""
    return value if isinstance(value, cls) else cls(**dict(value or {}))


class DINOFlat(Flat):
    """The shared translation (the recipe), and DINO's heads, losses and crops."""

    def __init__(self, recipe: Recipe) -> None:
        super().__init__(recipe)
        self.parts = ("recipe", *PARTS)
        self.names |= set(FIELDS)

    def to_parts(self, args: Mapping[str, Any]) -> dict[str, Any]:
        out = super().to_parts({k: v for k, v in args.items() if k not in FIELDS})
        for part, cls in PARTS.items():
            given = {field: args[name] for name, (p, field) in FIELDS.items() if p == part and name in args}
            if given or part not in out:
                out[part] = {**dataclasses.asdict(cls()), **dict(args.get(part) or {}), **given}
        return out

    def flag(self, key: str, value: str) -> tuple[list[str], list[str]]:
        if key in FIELDS:
            part, field = FIELDS[key]
            return [], [f"--model.{part}.{field}", value]
        return super().flag(key, value)


DINO_FLAT = DINOFlat(Recipe(lr=5e-4, weight_decay=0.04, warmup_epochs=10.0, min_lr=1e-6))
