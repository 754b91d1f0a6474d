"""The flat arguments :class:`~vitkit.lit.ImageClassifier` took before its typed parts (``lr``, ``freeze_backbone``,
``lora_rank``, ``multi_label``, ``teacher``, ...), translated into the parts: the arguments of a checkpoint or a
config written then, and the ``--model.lr`` flags of a command line, so that each keeps working.

=========================================  ============================================================
flat argument                              part
=========================================  ============================================================
lr, weight_decay, betas, min_lr, ...       ``recipe.<same name>`` (every field of ``Recipe``)
multi_label                                ``labels``: ``MultiLabel`` if true, else ``SingleLabel``
label_smoothing, mixup, cutmix, ...        ``labels.<same name>``
multi_label_loss                           ``labels.loss`` (``pos_weight``, ``thresholds``: same name)
freeze_backbone                            ``adaptation``: ``Frozen``
lora_rank (> 0)                            ``adaptation``: ``LoRA`` of that ``rank``
lora_alpha, lora_dropout, lora_targets,    ``adaptation.alpha``, ``.dropout``, ``.targets``, ``.parts``,
lora_parts, lora_lr_scale                  ``.lr_scale``
head_init, head_norm                       ``adaptation.<same name>``
teacher, teacher_checkpoint                ``teacher.name``, ``teacher.checkpoint``
distillation, distill_alpha, distill_tau   ``teacher.distillation`` (``none``: no teacher), ``.alpha``, ``.tau``
=========================================  ============================================================
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from collections.abc import Mapping
from typing import Any

from vitkit.errors import UsageError
from vitkit.lora import check_adaptation, settings_of
from vitkit.training.recipe import DEIT

from .adaptation import Frozen, Full, LoRA
from .distill import check_distillation
from .labels import MultiLabel, SingleLabel

TRUE, FALSE = ("true", "1", "yes"), ("false", "0", "no")
RECIPE_FIELDS = ("lr", "weight_decay", "betas", "eps", "optimizer", "momentum", "layer_decay", "warmup_epochs",
                 "min_lr", "schedule", "ema_decay", "ema_is_model", "nonfinite_loss", "compile")
LABEL_FIELDS = {"label_smoothing": "label_smoothing", "mixup": "mixup", "cutmix": "cutmix",
                "mixup_prob": "mixup_prob", "mixup_switch_prob": "mixup_switch_prob"}
MULTI_LABEL_FIELDS = {"multi_label_loss": "loss", "pos_weight": "pos_weight", "thresholds": "thresholds"}
LORA_FIELDS = {"lora_alpha": "alpha", "lora_dropout": "dropout", "lora_targets": "targets", "lora_parts": "parts",
               "lora_lr_scale": "lr_scale"}
HEAD_FIELDS = {"head_init": "head_init", "head_norm": "head_norm"}
TEACHER_FIELDS = {"teacher": "name", "teacher_checkpoint": "checkpoint", "distillation": "distillation",
                  "distill_alpha": "alpha", "distill_tau": "tau"}
PARTS = ("recipe", "labels", "adaptation", "teacher")  # ImageClassifier's typed parts, by argument name
SWITCHES = ("multi_label", "freeze_backbone")  # the flat booleans that chose a kind
# the flat names; ``teacher`` is also the part's name, and flat only as the teacher's name (a string)
FLAT = {*RECIPE_FIELDS, *LABEL_FIELDS, *MULTI_LABEL_FIELDS, *LORA_FIELDS, *HEAD_FIELDS, *TEACHER_FIELDS,
        "multi_label", "freeze_backbone", "lora_rank"} - {"teacher"}


def is_flat(args: Mapping[str, Any]) -> bool:
    """Whether ``args`` (init arguments, a checkpoint's hyper-parameters) hold any flat argument."""
    return any(k in FLAT for k in args) or isinstance(args.get("teacher"), str)


def to_parts(args: Mapping[str, Any]) -> dict[str, Any]:
    """``args`` with its flat arguments replaced by the parts they describe (as config dicts, the form of a
    checkpoint), laid over the parts ``args`` may also hold; the other arguments as they are. What neither gives keeps
    the part's default."""
    for key in SWITCHES:
        if key in args and not isinstance(args[key], bool):
            raise ValueError(f"{key} must be true or false, got {args[key]!r}")
    out = {k: v for k, v in args.items() if k not in FLAT}
    recipe = {k: args[k] for k in RECIPE_FIELDS if k in args}
    if recipe:
        out["recipe"] = {**dataclasses.asdict(DEIT), **(args.get("recipe") or {}), **recipe}  # the module's default
    if any(k in args for k in (*LABEL_FIELDS, *MULTI_LABEL_FIELDS, "multi_label")):
        kind = MultiLabel if args.get("multi_label", _kind(args.get("labels")) == "MultiLabel") else SingleLabel
        fields = LABEL_FIELDS | (MULTI_LABEL_FIELDS if kind is MultiLabel else {})
        given = {new: args[old] for old, new in fields.items() if old in args}
        out["labels"] = kind(**_kept(args.get("labels"), kind), **given).as_config()
    if any(k in args for k in (*LORA_FIELDS, *HEAD_FIELDS, "freeze_backbone", "lora_rank")):
        out["adaptation"] = _adaptation(args).as_config()
    if isinstance(args.get("teacher"), str) or any(k in args for k in TEACHER_FIELDS if k != "teacher"):
        out["teacher"] = _teacher(args)
    return out


def _kind(part: Any) -> str | None:
    """The class name of a part's config dict."""
    return str(part.get("class_path", "")).rpartition(".")[2] if isinstance(part, Mapping) else None


def _kept(part: Any, kind: type) -> dict[str, Any]:
    """The init_args of a part's config dict that ``kind`` takes."""
    takes = inspect.signature(kind.__init__).parameters
    given = (part.get("init_args") or {}) if isinstance(part, Mapping) else {}
    return {k: v for k, v in given.items() if k in takes and k != "self"}


def _adaptation(args: Mapping[str, Any]):
    lora = settings_of(args)
    check_adaptation(lora, bool(args.get("freeze_backbone")), args.get("lora_lr_scale", 10.0))
    was = _kind(args.get("adaptation"))
    if lora.rank:
        kind = LoRA
    elif args.get("freeze_backbone"):
        kind = Frozen
    else:  # lora_rank 0 or freeze_backbone false ends the kind they named; the part's own kind otherwise
        ended = ("LoRA" if "lora_rank" in args else None, "Frozen" if "freeze_backbone" in args else None)
        kind = {"LoRA": LoRA, "Frozen": Frozen}.get(was, Full) if was not in ended else Full
    given = {new: args[old] for old, new in (HEAD_FIELDS | (LORA_FIELDS if kind is LoRA else {})).items()
             if old in args}
    if lora.rank:
        given["rank"] = lora.rank
    return kind(**{**_kept(args.get("adaptation"), kind), **given})


def _teacher(args: Mapping[str, Any]) -> dict[str, Any] | None:
    name = args.get("teacher")
    kind = check_distillation(args.get("distillation"), name, args.get("distill_alpha", 0.5),
                              args.get("distill_tau", 1.0))
    if kind == "none":
        return None
    given = {new: args[old] for old, new in TEACHER_FIELDS.items() if args.get(old) is not None}
    return {"checkpoint": None, "alpha": 0.5, "tau": 1.0, **given, "distillation": kind}


def argv_to_parts(argv: list[str]) -> list[str]:
    """A command line's flat ``--model.X`` flags (``--model.init_args.X``, ``--model.X=V``) as the parts' flags:
    ``--model.lr 1e-3`` -> ``--model.recipe.lr 1e-3``, ``--model.lora_rank 8`` -> ``--model.adaptation LoRA
    --model.adaptation.rank 8``, ``--model.multi_label true`` -> ``--model.labels MultiLabel``. A flag that chooses
    a part's kind goes before the first translated flag, so that the part's other flags apply to that kind."""
    kinds: list[str] = []
    rest: list[str] = []
    first = None
    i = 0
    while i < len(argv):
        flag, eq, value = argv[i].partition("=")
        key = flag.removeprefix("--model.").removeprefix("init_args.") if flag.startswith("--model.") else None
        if key not in FLAT | {"teacher"} or (not eq and i + 1 >= len(argv)):
            rest.append(argv[i])
            i += 1
            continue
        if not eq:
            value, i = argv[i + 1], i + 1
        i += 1
        first = len(rest) if first is None else first
        chosen, flags = _flag(key, value)
        kinds += chosen
        rest += flags
    return _nulls_as_mappings(rest if first is None else rest[:first] + kinds + rest[first:])


def _nulls_as_mappings(argv: list[str]) -> list[str]:
    """``--model.recipe.layer_decay null`` as ``--model.recipe '{"layer_decay": null}'``: jsonargparse refuses a null
    given to one field of a part inside the module's class path, and takes the same as a mapping, laid over the
    part's other fields."""
    out, i = [], 0
    while i < len(argv):
        flag, eq, value = argv[i].partition("=")
        if not eq and i + 1 < len(argv):
            value = argv[i + 1]
        path = flag.removeprefix("--model.").removeprefix("init_args.").split(".")
        if flag.startswith("--model.") and len(path) == 2 and path[0] in PARTS and \
                value.strip().lower() in ("null", "none", "~"):
            out += [f"--model.{path[0]}", json.dumps({path[1]: None})]
            i += 1 if eq else 2
            continue
        out.append(argv[i])
        i += 1
    return out


def _flag(key: str, value: str) -> tuple[list[str], list[str]]:
    """(the flags that choose a part's kind, the other flags) of one flat flag."""
    word = value.strip().lower()
    if key in SWITCHES and word not in TRUE + FALSE:
        raise UsageError(f"--model.{key} expects true or false, got {value!r}")
    true = word in TRUE
    if key in RECIPE_FIELDS:
        return [], [f"--model.recipe.{key}", value]
    if key == "multi_label":
        return ["--model.labels", "MultiLabel" if true else "SingleLabel"], []
    if key == "freeze_backbone":
        return ["--model.adaptation", "Frozen" if true else "Full"], []
    if key == "lora_rank":
        try:
            rank = int(value)  # a negative one goes to LoRA, which refuses it
        except ValueError:
            raise UsageError(f"--model.lora_rank expects an integer (0: no adapters), got {value!r}") from None
        return (["--model.adaptation", "LoRA", "--model.adaptation.rank", str(rank)] if rank
                else ["--model.adaptation", "Full"]), []
    if key == "teacher" and (value.strip().lower() in ("null", "none") or value.lstrip().startswith("{")):
        return [], ["--model.teacher", value]  # the part itself, or none
    if key == "distillation" and value.strip().lower() in ("none", "null"):
        return [], ["--model.teacher", "null"]
    for table, part in ((LABEL_FIELDS, "labels"), (MULTI_LABEL_FIELDS, "labels"), (LORA_FIELDS, "adaptation"),
                        (HEAD_FIELDS, "adaptation"), (TEACHER_FIELDS, "teacher")):
        if key in table:
            return [], [f"--model.{part}.{table[key]}", value]
    raise KeyError(key)
