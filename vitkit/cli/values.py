"""``vitkit train``'s values checked against the types of the classes that take them, before LightningCLI parses
them: a value that does not fit, a kind that names no class, a field a part does not have end the command in one
line of vitkit's words (``--model.recipe.lr expects a float, got 'abc'``), found from the classes' own annotations and
not read out of jsonargparse's message. What this does not reach (a class's own check, a type it does not know)
is refused by jsonargparse, or by the class, in their own words.

A value is checked where the classes say its type: the module's, the data module's and the trainer's arguments,
a dataclass part's fields (the recipe) and the arguments of the kind a part's class path chooses (``--model.adaptation
LoRA --model.adaptation.rank 8``), given as flags or in a config file."""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import types
import typing
from typing import Any, Literal, Union

import yaml

from vitkit.errors import UsageError
from vitkit.training.parts import class_at

from .model_args import configs_of, read_config, section_class

UNKNOWN = object()  # a type this check leaves to jsonargparse


def check_values(argv: list[str]) -> None:
    """The values ``argv`` gives (its config files' first, then its flags, in order), each against its type."""
    import lightning as L

    roots = {"model": class_at(section_class(argv, "model")), "data": class_at(section_class(argv, "data") or ""),
             "trainer": L.Trainer}
    chosen: dict[tuple[str, ...], type] = {}  # the kinds chosen so far, by their path
    for path in configs_of(argv):
        text = read_config(path) or {}
        for section, root in roots.items():
            if isinstance(text.get(section), dict) and isinstance(root, type):
                init = text[section].get("init_args", text[section]) if "class_path" in text[section] else \
                    text[section]
                if isinstance(init, dict):
                    _check_mapping(root, (section,), init, chosen)
    for flag, value in _flags(argv):
        keys = [k for k in flag.removeprefix("--").split(".") if k != "init_args"]
        root = roots.get(keys[0])
        if isinstance(root, type) and len(keys) > 1 and keys[-1] not in ("class_path", "help"):
            _check_flag(root, keys, flag, value, chosen)


def _flags(argv: list[str]) -> list[tuple[str, str]]:
    """(flag, value) of each ``--a.b VALUE`` / ``--a.b=VALUE`` of ``argv`` (not a list's ``+=``)."""
    out = []
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if not flag.startswith("--") or "." not in flag or flag.endswith("+"):
            continue
        if not eq:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                continue
            value = argv[i + 1]
        out.append((flag, value))
    return out


def _value(text: str) -> Any:
    """A command line's value as jsonargparse reads it: YAML, else the text itself."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _check_flag(root: type, keys: list[str], flag: str, text: str, chosen: dict) -> None:
    owner, ann = root, UNKNOWN
    for depth, key in enumerate(keys[1:], start=1):
        fields = _fields(owner)
        if fields is None:
            return
        if key not in fields:
            _no_field(owner, key, "--" + ".".join(keys[:depth]), flag)
            return
        ann = fields[key]
        if depth == len(keys) - 1:
            break
        owner = _kind_of(ann, tuple(keys[:depth + 1]), chosen, owner, key)
        if owner is None:
            return
    value = _value(text)
    if _is_part(ann) and (isinstance(value, str) or (isinstance(value, dict) and "class_path" in value)):
        kind = _kind(value if isinstance(value, str) else value["class_path"], _base(ann), flag)
        chosen[tuple(keys)] = kind
        return
    if isinstance(value, dict) and (_is_part(ann) or _is_dataclass(ann)):
        owner = _kind_of(ann, tuple(keys), chosen, owner, keys[-1])
        if owner is not None:
            _check_mapping(owner, tuple(keys), value, chosen, flag)
        return
    if not _fits(value, ann):
        raise UsageError(f"{flag} expects {_describe(ann)}, got {text!r}")


def _check_mapping(owner: type, path: tuple[str, ...], values: dict, chosen: dict, flag: str | None = None) -> None:
    """A config's (or a mapping flag's) values for ``owner``'s fields."""
    fields = _fields(owner)
    if fields is None:
        return
    for key, value in values.items():
        name = f"--{'.'.join((*path, str(key)))}"
        if key not in fields or value is None:
            continue  # a field the class does not take (jsonargparse names it, or the flat arguments' refusal), or a
            # config's null: the class's default or its own "give it" (a recipe's data root)
        ann = fields[key]
        if _is_part(ann) and (isinstance(value, str) or (isinstance(value, dict) and "class_path" in value)):
            kind = _kind(value if isinstance(value, str) else value["class_path"], _base(ann), name)
            chosen[(*path, key)] = kind
            if isinstance(value, dict) and isinstance(value.get("init_args"), dict):
                _check_mapping(kind, (*path, key), value["init_args"], chosen)
        elif isinstance(value, dict) and _is_dataclass(ann):
            _check_mapping(_base(ann), (*path, key), value, chosen)
        elif not _is_part(ann) and not _fits(value, ann):
            raise UsageError(f"{name} expects {_describe(ann)}, got {_said(value)!r}")


def _said(value: Any) -> str:
    return value if isinstance(value, str) else yaml.safe_dump(value, default_flow_style=True).strip()


def _fields(owner: type) -> dict[str, Any] | None:
    """The annotated arguments of a class (a dataclass's fields), or None where they do not resolve."""
    try:
        if dataclasses.is_dataclass(owner):
            hints = typing.get_type_hints(owner)
            return {f.name: hints.get(f.name, UNKNOWN) for f in dataclasses.fields(owner)}
        hints = typing.get_type_hints(owner.__init__)
        params = inspect.signature(owner.__init__).parameters
    except Exception:  # noqa: BLE001 - annotations that do not resolve here: jsonargparse says what it can
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None  # it takes more than it names (a base class's arguments): jsonargparse's to check
    return {n: hints.get(n, UNKNOWN) for n, p in params.items() if n != "self"}


def _no_field(owner: type, key: str, part_flag: str, flag: str) -> None:
    names = [n for n in (_fields(owner) or {})]
    if dataclasses.is_dataclass(owner):
        close = difflib.get_close_matches(key, names, n=1)
        raise UsageError(f"{flag}: {owner.__name__} has no field {key!r}"
                         + (f" (did you mean {close[0]}?)" if close else "") + f"; it has {', '.join(names)}")
    if "." in part_flag:  # a part's kind (the module's own arguments are jsonargparse's to name)
        raise UsageError(f"{flag}: {owner.__name__} takes no {key!r} (another kind may: choose it first, {part_flag} "
                         "KIND)")


def _kind_of(ann: Any, path: tuple[str, ...], chosen: dict, owner: type, key: str) -> type | None:
    """The class whose fields a part's fields are: the kind chosen for it so far, a dataclass part's own class, or the
    kind of the argument's default."""
    if path in chosen:
        return chosen[path]
    base = _base(ann)
    if _is_dataclass(ann):
        return base
    if not _is_part(ann):
        return None
    default = inspect.signature(owner).parameters.get(key)
    default = getattr(default, "default", None)
    lazy = getattr(default, "_lazy_class_type", None)
    kind = lazy if isinstance(lazy, type) else type(default) if isinstance(default, base) else None
    return kind


def _base(ann: Any) -> Any:
    """``X`` of ``X | None``."""
    if typing.get_origin(ann) in (Union, types.UnionType):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        return args[0] if len(args) == 1 else ann
    return ann


def _is_dataclass(ann: Any) -> bool:
    base = _base(ann)
    return isinstance(base, type) and dataclasses.is_dataclass(base)


def _is_part(ann: Any) -> bool:
    """A class taken by class path: a class of vitkit's own that is not a dataclass (the module's parts)."""
    base = _base(ann)
    return isinstance(base, type) and not dataclasses.is_dataclass(base) and base.__module__.startswith("vitkit.")


def _kind(name: str, base: type, flag: str) -> type:
    """The kind of ``base`` that ``name`` chooses: a class path, or the name of an imported subclass."""
    found = class_at(name) if "." in name else next(
        (c for c in _subclasses(base) if c.__name__ == name), None)
    if found is None:
        raise UsageError(f"{flag}: {name!r} names no class it takes")
    if not (isinstance(found, type) and issubclass(found, base)):
        raise UsageError(f"{flag}: {name!r} is not a kind of {base.__name__}")
    return found


def _subclasses(base: type) -> list[type]:
    out, todo = [], [base]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo += cls.__subclasses__()
    return out


def _fits(value: Any, ann: Any) -> bool:
    """Whether a value read from YAML fits ``ann``; True for a type this check does not know."""
    if ann is UNKNOWN or ann is Any or ann is inspect.Parameter.empty:
        return True
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if ann is type(None) or ann is None:
        return value is None
    if origin in (Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if origin is Literal:
        return value in args
    if ann is bool:
        return isinstance(value, bool)
    if ann is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if ann is float:  # YAML 1.1 reads 1e-3 as a string; jsonargparse takes it as the float
        return isinstance(value, (int, float)) and not isinstance(value, bool) or isinstance(value, str) and \
            _is_float(value)
    if ann is str:
        return value is not None and not isinstance(value, (dict, list))
    if origin in (list, tuple) or ann in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False
        if args and origin is tuple and Ellipsis not in args:
            return len(args) == len(value) and all(_fits(v, a) for v, a in zip(value, args, strict=True))
        return not args or all(_fits(v, args[0]) for v in value)
    return True


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _describe(ann: Any) -> str:
    """What a type takes, in words: ``a float or null``, ``one of 'bce', 'asl'``."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin in (Union, types.UnionType):
        return " or ".join(dict.fromkeys(_describe(a) for a in args))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    words = {type(None): "null", bool: "true or false", int: "an int", float: "a float", str: "a string"}
    if ann in words:
        return words[ann]
    if origin in (list, tuple) or ann in (list, tuple):
        if args and origin is tuple and Ellipsis not in args:
            return f"a list of {len(args)} ({', '.join(_describe(a) for a in args)})"
        return "a list" + (f" (each {_describe(args[0])})" if args else "")
    return getattr(ann, "__name__", str(ann))
