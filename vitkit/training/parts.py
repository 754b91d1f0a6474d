"""Typed parts of a training module: small objects of settings, each a choice among kinds (one label per image or
several; the whole model, a frozen backbone or LoRA adapters), that LightningCLI takes as nested arguments by class
path, as it takes an optimizer or a callback:

    --model.adaptation LoRA --model.adaptation.rank 8
    model: {init_args: {adaptation: {class_path: vitkit.lit.LoRA, init_args: {rank: 8}}}}

A part's arguments are its attributes. In a module's hyper-parameters (and so in its checkpoint) a part is stored as
that same ``{"class_path": ..., "init_args": ...}`` dict of plain values, which :func:`part_from` turns back into the
part; only a subclass of the argument's own base is built from a file."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any, TypeVar

from vitkit.errors import UsageError, UsageTypeError

P = TypeVar("P", bound="Part")


class Part:
    """A typed part: its ``__init__`` arguments kept as attributes of the same names, compared and shown by them."""

    def init_args(self) -> dict[str, Any]:
        names = [n for n in inspect.signature(type(self).__init__).parameters if n != "self"]
        return {n: getattr(self, n) for n in names}

    def as_config(self) -> dict[str, Any]:
        """``{"class_path": ..., "init_args": ...}`` of plain values (the form of a config file and a checkpoint)."""
        return {"class_path": f"{type(self).__module__}.{type(self).__qualname__}", "init_args": self.init_args()}

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.init_args() == other.init_args()

    __hash__ = None  # compared by value, and some arguments are lists

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.init_args().items())})"


def class_at(path: str) -> Any:
    """What the dotted ``path`` names (``vitkit.lit.Segmenter``), or None where its module does not import or has no
    such name."""
    module, _, name = str(path).rpartition(".")
    try:
        return getattr(importlib.import_module(module), name, None) if module else None
    except (ImportError, ValueError):  # no such module, or a malformed path (``a..b``)
        return None


def part_from(value: Any, base: type[P], default: P | None = None) -> P | None:
    """``value`` as a part of kind ``base``: a part itself, its config dict (a class path naming an imported subclass
    of ``base``, and its arguments), or None for ``default``."""
    if value is None:
        return default
    lazy = getattr(value, "_lazy_class_type", None)  # a default given as jsonargparse's lazy_instance: not made yet
    if isinstance(lazy, type) and issubclass(lazy, base):
        return lazy(**value._lazy_kwargs)
    if isinstance(value, base):
        return value
    if isinstance(value, dict) and "class_path" in value:
        path = str(value["class_path"])
        cls = class_at(path) if path.startswith("vitkit.") else None
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise UsageError(f"{value['class_path']!r} is not a kind of {base.__name__} vitkit has")
        return cls(**dict(value.get("init_args") or {}))
    raise UsageTypeError(f"expected a {base.__name__} (or its class_path and init_args), got {value!r}")


def config_of(value: Any) -> Any:
    """A part or a dataclass as plain values, for the hyper-parameters; anything else as it is."""
    if isinstance(value, Part):
        return value.as_config()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value
