"""The flat arguments a training module took before its typed parts (``lr``, ``warmup_epochs``, ``freeze_backbone``,
``lora_rank``, ...) and the parts they became. Nothing is translated as it is read: ``vitkit convert OLD.ckpt
NEW.ckpt`` upgrades a checkpoint written with them (:meth:`Flat.to_parts`), and a flag or config that gives one is
refused in one line naming the part's flag (:meth:`Flat.flag`). One :class:`Flat` per module (``Module.FLAT``); a
task with parts of its own extends it (the classifier's labels and teacher).

=========================================  ============================================================
flat argument                              part
=========================================  ============================================================
lr, weight_decay, betas, min_lr, ...       ``recipe.<same name>`` (every field of ``Recipe``)
freeze_backbone                            ``adaptation``: ``Frozen``
lora_rank (> 0)                            ``adaptation``: ``LoRA`` of that ``rank``
lora_alpha, lora_dropout, lora_targets,    ``adaptation.alpha``, ``.dropout``, ``.targets``, ``.parts``,
lora_parts, lora_lr_scale                  ``.lr_scale``
head_init, head_norm                       ``adaptation.<same name>``
=========================================  ============================================================
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any

from vitkit.errors import UsageError
from vitkit.models.lora import check_adaptation, settings_of

from .adaptation import Frozen, Full, LoRA
from .parts import class_at
from .recipe import Recipe

TRUE, FALSE = ("true", "1", "yes"), ("false", "0", "no")
RECIPE_FIELDS = tuple(f.name for f in dataclasses.fields(Recipe))
LORA_FIELDS = {"lora_alpha": "alpha", "lora_dropout": "dropout", "lora_targets": "targets", "lora_parts": "parts",
               "lora_lr_scale": "lr_scale"}
HEAD_FIELDS = {"head_init": "head_init", "head_norm": "head_norm"}
ADAPTATION_FLAT = {*LORA_FIELDS, *HEAD_FIELDS, "freeze_backbone", "lora_rank"}


class Flat:
    """A module's flat arguments and the one translation of them into its parts: ``recipe`` (laid over the module's
    default ``recipe``) and, where the module takes one, ``adaptation``."""

    switches: tuple[str, ...] = ("freeze_backbone",)  # the flat booleans that chose a kind

    def __init__(self, recipe: Recipe, adaptation: bool = False) -> None:
        self.recipe, self.adaptation = recipe, adaptation
        self.parts: tuple[str, ...] = ("recipe", "adaptation") if adaptation else ("recipe",)
        self.names: set[str] = {*RECIPE_FIELDS, *(ADAPTATION_FLAT if adaptation else ())}

    def is_flat(self, args: Mapping[str, Any]) -> bool:
        """Whether ``args`` (init arguments, a checkpoint's hyper-parameters) hold any flat argument."""
        return any(k in self.names for k in args)

    def to_parts(self, args: Mapping[str, Any]) -> dict[str, Any]:
        """``args`` with its flat arguments replaced by the parts they describe (as config dicts, the form of a
        checkpoint), laid over the parts ``args`` may also hold; the other arguments as they are. What neither gives
        keeps the part's default."""
        for key in self.switches:
            if key in args and not isinstance(args[key], bool):
                raise UsageError(f"{key} must be true or false, got {args[key]!r}")
        out = {k: v for k, v in args.items() if k not in self.names}
        recipe = {k: args[k] for k in RECIPE_FIELDS if k in args}
        if recipe:
            out["recipe"] = {**dataclasses.asdict(self.recipe), **(args.get("recipe") or {}), **recipe}
        if self.adaptation and any(k in args for k in ADAPTATION_FLAT):
            out["adaptation"] = adaptation_of(args).as_config()
        return out

    def flag(self, key: str, value: str) -> tuple[list[str], list[str]]:
        """(the flags that choose a part's kind, the other flags) that say what one flat flag said."""
        word = value.strip().lower()
        if key in self.switches and word not in TRUE + FALSE:
            raise UsageError(f"--model.{key} expects true or false, got {value!r}")
        if key in RECIPE_FIELDS:
            return [], [f"--model.recipe.{key}", value]
        if key == "freeze_backbone":
            return ["--model.adaptation", "Frozen" if word in TRUE else "Full"], []
        if key == "lora_rank":
            try:
                rank = int(value)  # a negative one goes to LoRA, which refuses it
            except ValueError:
                raise UsageError(f"--model.lora_rank expects an integer (0: no adapters), got {value!r}") from None
            return (["--model.adaptation", "LoRA", "--model.adaptation.rank", str(rank)] if rank
                    else ["--model.adaptation", "Full"]), []
        table = LORA_FIELDS | HEAD_FIELDS
        if key in table:
            return [], [f"--model.adaptation.{table[key]}", value]
        raise KeyError(key)

    def takes_flag(self, key: str | None) -> bool:
        """Whether ``--model.<key>`` is a flat flag of before the parts."""
        return key in self.names


def kind_of(part: Any) -> str | None:
    """The class name of a part's config dict."""
    return str(part.get("class_path", "")).rpartition(".")[2] if isinstance(part, Mapping) else None


def kept(part: Any, kind: type) -> dict[str, Any]:
    """The init_args of a part's config dict that ``kind`` takes."""
    takes = inspect.signature(kind.__init__).parameters
    given = (part.get("init_args") or {}) if isinstance(part, Mapping) else {}
    return {k: v for k, v in given.items() if k in takes and k != "self"}


def adaptation_of(args: Mapping[str, Any]):
    """The adaptation part that flat ``freeze_backbone``, ``lora_*`` and ``head_*`` arguments describe, over the
    ``adaptation`` part ``args`` may also hold."""
    lora = settings_of(args)
    check_adaptation(lora, bool(args.get("freeze_backbone")), args.get("lora_lr_scale", 10.0))
    was = kind_of(args.get("adaptation"))
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
    return kind(**{**kept(args.get("adaptation"), kind), **given})


def refuse_flat_checkpoint(path: Any, hparams: Mapping[str, Any], flat: Flat | None) -> None:
    """A checkpoint of a module's flat arguments (written before its parts) ends in one line naming the command
    that upgrades it; today's checkpoints pass."""
    if flat is not None and flat.is_flat(hparams):
        names = sorted((k for k in hparams if flat.takes_flag(k)), key=lambda k: (k != "lr", k))[:4]  # lr first
        raise UsageError(f"{path} holds the flat arguments of a vitkit from before the modules' parts "
                         f"({', '.join(names)}, ...); upgrade it once: vitkit convert {path} UPGRADED.ckpt")


def flat_of(class_path: Any) -> Flat | None:
    """The :class:`Flat` of the vitkit module class ``class_path`` names (``vitkit.lit.Segmenter``); None for
    another class, or one without parts."""
    path = str(class_path or "")
    flat = getattr(class_at(path), "FLAT", None) if path.startswith("vitkit.") else None
    return flat if isinstance(flat, Flat) else None
