"""The training recipes: the commented YAML files of ``configs/``, shipped inside the package.

``configs/`` stays at the top of the source tree, where people look for it; the wheel carries the same files as
``vitkit/configs`` (``pyproject.toml`` maps the one onto the other), so an installed vitkit has its recipes
too. A recipe is named by its file name without ``.yaml``: ``vitkit train fit --config vit_tiny_digits``.
"""

from __future__ import annotations

import re
from pathlib import Path

PACKAGED = Path(__file__).resolve().parent / "configs"  # an installed wheel
SOURCE = Path(__file__).resolve().parents[1] / "configs"  # a source checkout (and its editable install)


def recipes_dir() -> Path:
    """The folder that holds the recipes: ``vitkit/configs`` of a wheel, ``configs/`` of a source checkout."""
    for folder in (PACKAGED, SOURCE):
        if folder.is_dir():
            return folder
    raise FileNotFoundError(f"vitkit's recipes are missing: neither {PACKAGED} nor {SOURCE} exists; reinstall vitkit")


def list_recipes() -> dict[str, str]:
    """Recipe name -> its first comment line (what the recipe trains, and on what)."""
    out = {}
    for path in sorted(recipes_dir().glob("*.yaml")):
        first = next((line for line in path.read_text().splitlines() if line.startswith("#")), "#")
        out[path.stem] = first.lstrip("#").strip()
    return out


def is_name(config: str) -> bool:
    """Whether a ``--config`` value is a bare name to look up (not a file that exists, a path or inline content)."""
    return re.fullmatch(r"[\w.-]+", config) is not None and not Path(config).exists()


def find(name: str) -> Path | None:
    """The file of recipe ``name`` (``vit_tiny_digits`` or ``vit_tiny_digits.yaml``), or None."""
    path = recipes_dir() / (name if name.endswith((".yaml", ".yml")) else f"{name}.yaml")
    return path if path.is_file() else None
