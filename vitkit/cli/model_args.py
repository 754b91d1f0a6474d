"""``vitkit train``'s model arguments before LightningCLI parses them: the module a command line chooses (``--model``,
a config's ``class_path``; the data module likewise), the flat arguments of before the module's parts refused in one
line that names the parts' flags (a ``--model.lr 1e-3`` flag, an ``lr: 1e-3`` in a config file), and a part's field
set to null given as jsonargparse takes it."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import yaml

from vitkit.errors import UsageError

CLASSIFIER = "vitkit.lit.ImageClassifier"


def _configs(argv: list[str]) -> list[tuple[int, str]]:
    """(index of the value, the value) of every ``--config`` / ``-c`` of ``argv``."""
    out = []
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag in ("--config", "-c"):
            if eq:
                out.append((i, value))
            elif i + 1 < len(argv):
                out.append((i + 1, argv[i + 1]))
    return out


def read_config(path: str) -> dict | None:
    """A config file's content, read once however many of the command's steps ask (the module it names, the flat
    arguments it may hold, the data settings a data module does not take), or None where it is not a readable YAML
    mapping (jsonargparse reads it and says what is wrong). Read-only: the steps share it."""
    try:
        stat = Path(path).stat()
    except OSError:
        return None
    return _read(str(Path(path).resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=16)
def _read(path: str, mtime_ns: int, size: int) -> dict | None:
    try:
        text = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return None
    return text if isinstance(text, dict) else None


def configs_of(argv: list[str]) -> list[str]:
    """The config files ``argv`` gives, in order."""
    return [path for _, path in _configs(argv)]


def section_class(argv: list[str], section: str) -> str | None:
    """The class path ``argv`` chooses for ``section`` (``model``, ``data``): ``--section X``, else the last config's,
    else None. A short name is one of ``vitkit.lit``'s."""
    chosen = None
    for _, path in _configs(argv):
        part = (read_config(path) or {}).get(section)
        if isinstance(part, dict) and part.get("class_path"):
            chosen = str(part["class_path"])
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag in (f"--{section}", f"--{section}.class_path"):
            chosen = value if eq else (argv[i + 1] if i + 1 < len(argv) else chosen)
    return chosen if chosen is None or "." in chosen else f"vitkit.lit.{chosen}"


def model_class(argv: list[str]) -> str:
    """The module's class path that ``argv`` chooses: ``--model X``, else the last config's, else the default."""
    return section_class(argv, "model") or CLASSIFIER


def refuse_flat(argv: list[str]) -> None:
    """Flat arguments of before the module's parts, as flags or in a config file, end the command in one line that
    says how the parts take them (every one given, not the first alone)."""
    from vitkit.training.flat import flat_of

    flat = flat_of(model_class(argv))
    if flat is None:
        return
    old, new = [], []
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        key = flag.removeprefix("--model.").removeprefix("init_args.") if flag.startswith("--model.") else None
        if not flat.takes_flag(key):
            continue
        if not eq:  # the next argument, unless it is the next flag
            value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else "VALUE"
        chosen, flags = flat.flag(key, value)
        if (chosen, flags) != ([], [flag, value]):  # (``--model.teacher null``: the part itself)
            old.append(f"--model.{key} {value}")
            new += chosen + flags
    if old:
        raise UsageError(f"{', '.join(old)}: the module takes its settings as parts now; give {' '.join(new)}")
    for _, path in _configs(argv):
        model = (read_config(path) or {}).get("model")
        init = model.get("init_args") if isinstance(model, dict) else None
        if isinstance(init, dict) and flat.is_flat(init):
            given = {k: _word(v) for k, v in init.items()
                     if flat.takes_flag(k) and flat.flag(k, _word(v)) != ([], [f"--model.{k}", _word(v)])}
            raise UsageError(f"{path}: model.init_args holds flat arguments of before the module's parts "
                             f"({', '.join(given)}); write them under init_args as the parts take them: "
                             f"{_as_yaml(sum((sum(flat.flag(k, v), []) for k, v in given.items()), []))} (a "
                             "checkpoint of then: vitkit convert OLD.ckpt NEW.ckpt)")


def _as_yaml(flags: list[str]) -> str:
    """Parts' flags (``--model.recipe.lr 1e-3 --model.adaptation Frozen``) as a config's init_args say them
    (``recipe: {lr: 1e-3}; adaptation: Frozen``)."""
    parts: dict[str, Any] = {}
    for flag, value in zip(flags[::2], flags[1::2], strict=True):
        name, _, field = flag.removeprefix("--model.").partition(".")
        if not field:
            parts[name] = value
            continue
        if isinstance(parts.get(name), str):  # a kind chosen, then its fields: its class_path and init_args
            parts[name] = {"class_path": parts[name], "init_args": {}}
        slot = parts.setdefault(name, {})
        (slot["init_args"] if "init_args" in slot else slot)[field] = value
    return "; ".join(f"{k}: {_inline(v)}" for k, v in parts.items())


def _inline(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_inline(v)}" for k, v in value.items()) + "}"
    return str(value)


def _word(value) -> str:
    return json.dumps(value) if isinstance(value, (bool, type(None))) else str(value)


def nulls_as_mappings(argv: list[str]) -> list[str]:
    """``--model.recipe.layer_decay null`` as ``--model.recipe '{"layer_decay": null}'``: jsonargparse refuses a null
    given to one field of a part inside the module's class path, and takes the same as a mapping, laid over the
    part's other fields."""
    from vitkit.training.flat import flat_of

    flat = flat_of(model_class(argv))
    parts = flat.parts if flat is not None else ()
    out, i = [], 0
    while i < len(argv):
        flag, eq, value = argv[i].partition("=")
        if not eq and i + 1 < len(argv):
            value = argv[i + 1]
        path = flag.removeprefix("--model.").removeprefix("init_args.").split(".")
        if flag.startswith("--model.") and len(path) == 2 and path[0] in parts and \
                value.strip().lower() in ("null", "none", "~"):
            out += [f"--model.{path[0]}", json.dumps({path[1]: None})]
            i += 1 if eq else 2
            continue
        out.append(argv[i])
        i += 1
    return out
