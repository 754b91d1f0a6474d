"""Config values checked against their fields' types before a model is built: an override from the command line,
a JSON string or a checkpoint's config is refused by name, with the type the field takes (``depth`` must be an int
>= 1, ``mlp_ratio`` a number > 0), instead of failing somewhere inside the model's constructor."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, Literal, Union

from vitkit.errors import UsageError, UsageTypeError

# the smallest value of the numeric fields that count something: the same name means the same in every family
AT_LEAST_ONE = {"img_size", "patch_size", "in_chans", "embed_dim", "depth", "depths", "num_heads", "num_kv_heads",
                "window_size", "pretrained_window_sizes", "src_vocab_size", "tgt_vocab_size", "d_model", "d_ff",
                "max_len", "sliding_window", "rope_ref_grid", "max_patches"}
AT_LEAST_ZERO = {"num_classes", "reg_tokens", "num_encoder_layers", "num_decoder_layers", "pad_id", "bos_id",
                 "eos_id"}
RATES = {"drop_rate", "pos_drop_rate", "proj_drop_rate", "attn_drop_rate", "drop_path_rate", "dropout",
         "attn_dropout", "label_smoothing"}  # in [0, 1)
POSITIVE = {"mlp_ratio", "norm_eps", "crop_pct", "rope_temperature"}


@functools.cache
def field_types(cfg_cls: type) -> dict[str, Any]:
    """Field name -> its type hint, resolved (the configs' modules may use postponed annotations)."""
    hints = typing.get_type_hints(cfg_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cfg_cls)}


def conforms(value: Any, hint: Any) -> bool:
    """Whether ``value`` (as JSON, YAML or Python gives it: lists for tuples) is of type ``hint``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if origin in (Union, types.UnionType):
        return any(conforms(value, a) for a in args)
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if hint is tuple or origin is tuple:
        if not isinstance(value, (tuple, list)):
            return False
        if not args:
            return True
        if len(args) == 2 and args[1] is Ellipsis:
            return all(conforms(v, args[0]) for v in value)
        return len(value) == len(args) and all(conforms(v, a) for v, a in zip(value, args, strict=True))
    if hint is list or origin is list:
        return isinstance(value, (tuple, list)) and all(conforms(v, args[0]) for v in value) if args else \
            isinstance(value, (tuple, list))
    if hint is dict or origin is dict:
        return isinstance(value, dict)
    return True  # a type these configs do not use: the constructor checks it


def describe(hint: Any) -> str:
    """A type hint as a user reads it: 'an int', 'a number', "one of 'sdpa', 'math'", 'a list of 2 ints'."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is type(None):
        return "null"
    if origin in (Union, types.UnionType):
        return " or ".join(describe(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    names = {bool: "true or false", int: "an int", float: "a number", str: "a string", dict: "a mapping"}
    if hint in names:
        return names[hint]
    if hint is tuple or origin is tuple or hint is list or origin is list:
        if not args:
            return "a list"
        if len(args) == 2 and args[1] is Ellipsis or origin is list:
            return f"a list of {_plural(args[0])}"
        return f"a list of {len(args)} {_plural(args[0])}" if len(set(args)) == 1 else \
            f"a list of ({', '.join(describe(a) for a in args)})"
    return getattr(hint, "__name__", str(hint))


def _plural(hint: Any) -> str:
    return {int: "ints", float: "numbers", str: "strings", bool: "booleans"}.get(hint, describe(hint))


def _numbers(value: Any) -> list[float]:
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [value]
    if isinstance(value, (list, tuple)):
        return [n for v in value for n in _numbers(v)]
    return []


def check_values(owner: str, cfg_cls: type, values: dict[str, Any]) -> None:
    """Refuse values of the wrong type or out of range, naming the field, what it takes and what came."""
    hints = field_types(cfg_cls)
    for name, value in values.items():
        if name not in hints:
            continue  # unknown names are refused by the caller, with the list of fields
        if not conforms(value, hints[name]):
            wanted = describe(hints[name])  # a string that is not one of the choices is a wrong value, not type
            error = UsageError if isinstance(value, str) and "one of" in wanted else UsageTypeError
            raise error(f"{owner}: {name} must be {wanted}, got {_shown(value)}")
        nums = _numbers(value)
        if name in AT_LEAST_ONE and any(n < 1 for n in nums):
            raise UsageError(f"{owner}: {name} must be >= 1, got {_shown(value)}")
        if name in AT_LEAST_ZERO and any(n < 0 for n in nums):
            raise UsageError(f"{owner}: {name} must be >= 0, got {_shown(value)}")
        if name in RATES and any(not 0 <= n < 1 for n in nums):
            raise UsageError(f"{owner}: {name} must be in [0, 1), got {_shown(value)}")
        if name in POSITIVE and any(n <= 0 for n in nums):
            raise UsageError(f"{owner}: {name} must be > 0, got {_shown(value)}")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
