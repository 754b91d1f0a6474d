"""``vitkit train`` with the flat arguments a training module took before its typed parts: the ``--model.lr 1e-3``
flags of a command line and the ``lr: 1e-3`` of a config file are put as the parts take them (the module's ``FLAT``:
``vitkit/training/flat.py`` says how), before LightningCLI parses them."""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

import yaml

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


def _read(path: str) -> dict | None:
    p = Path(path)
    try:
        text = yaml.safe_load(p.read_text()) if p.is_file() else None
    except (OSError, yaml.YAMLError):
        return None  # jsonargparse reads it and says what is wrong
    return text if isinstance(text, dict) else None


def model_class(argv: list[str]) -> str:
    """The module's class path that ``argv`` chooses: ``--model X``, else the last config's, else the default."""
    chosen = None
    for _, path in _configs(argv):
        model = (_read(path) or {}).get("model")
        if isinstance(model, dict) and model.get("class_path"):
            chosen = str(model["class_path"])
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag in ("--model", "--model.class_path"):
            chosen = value if eq else (argv[i + 1] if i + 1 < len(argv) else chosen)
    chosen = chosen or CLASSIFIER
    return chosen if "." in chosen else f"vitkit.lit.{chosen}"  # a short name is one of vitkit.lit's


def with_parts(argv: list[str]) -> list[str]:
    """``argv`` with the module's flat arguments, given as flags or in a config file, as its parts: a config file that
    holds them is read as a translated copy of itself (in a temporary folder named by the copy's content, under the
    file's own name, which names the run's folder)."""
    from vitkit.training.flat import flat_of

    flat = flat_of(model_class(argv))
    if flat is None:
        return argv
    out = list(argv)
    for i, path in _configs(argv):
        text = _read(path)
        model = (text or {}).get("model")
        init = model.get("init_args") if isinstance(model, dict) else None
        if not isinstance(init, dict) or not flat.is_flat(init):
            continue
        model["init_args"] = flat.to_parts(init)
        translated = yaml.safe_dump(text, sort_keys=False)
        digest = hashlib.sha256(translated.encode()).hexdigest()[:16]  # one folder per content, used again
        copy = Path(tempfile.gettempdir()) / f"vitkit-config-{digest}" / Path(path).name
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text(translated)
        out[i] = f"{out[i].partition('=')[0]}={copy}" if "=" in out[i] and out[i].startswith("-") else str(copy)
    return flat.argv(out)
