"""The flat arguments :class:`~vitkit.lit.ImageClassifier` took before its typed parts (``lr``, ``freeze_backbone``,
``lora_rank``, ``multi_label``, ``teacher``, ...), translated into the parts: the arguments of a checkpoint or a
config written then, and the ``--model.lr`` flags of a command line, so that each keeps working.

=========================================  ============================================================
flat argument                              part
=========================================  ============================================================
lr, weight_decay, betas, min_lr, ...       ``recipe.<same name>`` (every field of ``Recipe``, as every module's)
multi_label                                ``labels``: ``MultiLabel`` if true, else ``SingleLabel``
label_smoothing, mixup, cutmix, ...        ``labels.<same name>``
multi_label_loss                           ``labels.loss`` (``pos_weight``, ``thresholds``: same name)
freeze_backbone                            ``adaptation``: ``Frozen``
lora_rank, lora_*, head_init, head_norm    ``adaptation`` (as the segmenter's: ``vitkit/training/flat.py``)
teacher, teacher_checkpoint                ``teacher.name``, ``teacher.checkpoint``
distillation, distill_alpha, distill_tau   ``teacher.distillation`` (``none``: no teacher), ``.alpha``, ``.tau``
=========================================  ============================================================
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vitkit.training.flat import FALSE, TRUE, Flat, kept, kind_of
from vitkit.training.recipe import Recipe

from .distill import check_distillation
from .labels import MultiLabel, SingleLabel

LABEL_FIELDS = {"label_smoothing": "label_smoothing", "mixup": "mixup", "cutmix": "cutmix",
                "mixup_prob": "mixup_prob", "mixup_switch_prob": "mixup_switch_prob"}
MULTI_LABEL_FIELDS = {"multi_label_loss": "loss", "pos_weight": "pos_weight", "thresholds": "thresholds"}
TEACHER_FIELDS = {"teacher": "name", "teacher_checkpoint": "checkpoint", "distillation": "distillation",
                  "distill_alpha": "alpha", "distill_tau": "tau"}


class ClassifierFlat(Flat):
    """The shared translation (recipe, adaptation), and the classifier's labels and teacher."""

    switches = ("multi_label", "freeze_backbone")

    def __init__(self, recipe: Recipe) -> None:
        super().__init__(recipe, adaptation=True)
        self.parts = ("recipe", "labels", "adaptation", "teacher")  # ImageClassifier's typed parts, by argument name
        # ``teacher`` is also the part's name, and flat only as the teacher's name (a string)
        self.names |= {*LABEL_FIELDS, *MULTI_LABEL_FIELDS, *TEACHER_FIELDS, "multi_label"} - {"teacher"}

    def is_flat(self, args: Mapping[str, Any]) -> bool:
        return super().is_flat(args) or isinstance(args.get("teacher"), str)

    def to_parts(self, args: Mapping[str, Any]) -> dict[str, Any]:
        out = super().to_parts(args)
        if any(k in args for k in (*LABEL_FIELDS, *MULTI_LABEL_FIELDS, "multi_label")):
            kind = MultiLabel if args.get("multi_label", kind_of(args.get("labels")) == "MultiLabel") else SingleLabel
            fields = LABEL_FIELDS | (MULTI_LABEL_FIELDS if kind is MultiLabel else {})
            given = {new: args[old] for old, new in fields.items() if old in args}
            out["labels"] = kind(**kept(args.get("labels"), kind), **given).as_config()
        if isinstance(args.get("teacher"), str) or any(k in args for k in TEACHER_FIELDS if k != "teacher"):
            out["teacher"] = _teacher(args)
        return out

    def takes_flag(self, key: str | None) -> bool:
        return key in self.names or key == "teacher"

    def flag(self, key: str, value: str) -> tuple[list[str], list[str]]:
        word = value.strip().lower()
        if key == "multi_label":
            if word not in TRUE + FALSE:
                return super().flag(key, value)  # its one line
            return ["--model.labels", "MultiLabel" if word in TRUE else "SingleLabel"], []
        if key == "teacher" and (word in ("null", "none") or value.lstrip().startswith("{")):
            return [], ["--model.teacher", value]  # the part itself, or none
        if key == "distillation" and word in ("none", "null"):
            return [], ["--model.teacher", "null"]
        for table, part in ((LABEL_FIELDS, "labels"), (MULTI_LABEL_FIELDS, "labels"), (TEACHER_FIELDS, "teacher")):
            if key in table:
                return [], [f"--model.{part}.{table[key]}", value]
        return super().flag(key, value)


def _teacher(args: Mapping[str, Any]) -> dict[str, Any] | None:
    name = args.get("teacher")
    kind = check_distillation(args.get("distillation"), name, args.get("distill_alpha", 0.5),
                              args.get("distill_tau", 1.0))
    if kind == "none":
        return None
    given = {new: args[old] for old, new in TEACHER_FIELDS.items() if args.get(old) is not None}
    return {"checkpoint": None, "alpha": 0.5, "tau": 1.0, **given, "distillation": kind}
