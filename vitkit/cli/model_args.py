"""``vitkit train``'s model arguments before LightningCLI parses them: the module a command line chooses (``--model``,
a config's ``class_path``), the flat arguments of before the module's parts refused in one line that names the parts'
flags (a ``--model.lr 1e-3`` flag, an ``lr: 1e-3`` in a config file), and a part's field set to null given as
jsonargparse takes it."""

from __future__ import annotations

import functools
import json
from pathlib import Path

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


def model_class(argv: list[str]) -> str:
    """The module's class path that ``argv`` chooses: ``--model X``, else the last config's, else the default."""
    chosen = None
    for _, path in _configs(argv):
        model = (read_config(path) or {}).get("model")
        if isinstance(model, dict) and model.get("class_path"):
            chosen = str(model["class_path"])
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag in ("--model", "--model.class_path"):
            chosen = value if eq else (argv[i + 1] if i + 1 < len(argv) else chosen)
    chosen = chosen or CLASSIFIER
    return chosen if "." in chosen else f"vitkit.lit.{chosen}"  # a short name is one of vitkit.lit's


def refuse_flat(argv: list[str]) -> None:
    """A flat argument of before the module's parts, as a flag or in a config file, ends the command in one line
    that says how the parts take it."""
    from vitkit.training.flat import flat_of

    flat = flat_of(model_class(argv))
    if flat is None:
        return
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        key = flag.removeprefix("--model.").removeprefix("init_args.") if flag.startswith("--model.") else None
        value = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
        if flat.takes_flag(key) and flat.flag(key, value) != ([], [flag, value]):  # (``--model.teacher null``: the
            raise UsageError(flat.refusal(key, value))  # part itself)
    for _, path in _configs(argv):
        model = (read_config(path) or {}).get("model")
        init = model.get("init_args") if isinstance(model, dict) else None
        if isinstance(init, dict) and flat.is_flat(init):
            old = {k: _word(v) for k, v in init.items()
                   if flat.takes_flag(k) and flat.flag(k, _word(v)) != ([], [f"--model.{k}", _word(v)])}
            said = [" ".join(sum(flat.flag(k, v), [])) for k, v in old.items()]
            raise UsageError(f"{path}: model.init_args holds flat arguments of before the module's parts "
                             f"({', '.join(old)}); write them as the parts take them: {'; '.join(said)} (a "
                             "checkpoint of then: vitkit convert OLD.ckpt NEW.ckpt)")


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
