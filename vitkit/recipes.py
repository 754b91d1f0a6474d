"""The training recipes: the commented YAML files of ``vitkit/configs/``, shipped inside the package (``configs/`` at
the top of the source tree is a link to it, where people look for it). A recipe is named by its file name without
``.yaml``: ``vitkit train fit --config vit_tiny_digits``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from vitkit.errors import MissingFileError

PACKAGED = Path(__file__).resolve().parent / "configs"


def recipes_dir() -> Path:
    """The folder that holds the recipes, ``vitkit/configs``."""
    if not PACKAGED.is_dir():
        raise MissingFileError(f"vitkit's recipes are missing: {PACKAGED} does not exist; reinstall vitkit")
    return PACKAGED


@dataclass(frozen=True)
class RecipeInfo:
    """What ``vitkit recipes`` says of a recipe: what it trains, the hardware its trainer section asks for, and its
    header's ``# data:`` and ``# time:`` lines."""

    summary: str
    hardware: str
    data: str
    time: str


def list_recipes() -> dict[str, RecipeInfo]:
    """Recipe name -> what it trains (the header's prose, whole), on what hardware, data and time scale."""
    return {path.stem: describe(path.read_text()) for path in sorted(recipes_dir().glob("*.yaml"))}


def describe(text: str) -> RecipeInfo:
    """A recipe file's :class:`RecipeInfo`, read from its header comments (the prose before the first command line:
    whole sentences) and its ``trainer:`` lines (no YAML parser: ``vitkit recipes`` starts without one)."""
    header = [line[1:].strip() for line in text.splitlines() if line.startswith("#")]
    fields = {k: v.strip() for k, _, v in (line.partition(":") for line in header) if k in ("data", "time")}
    prose = []
    for line in header:
        if not line or line.startswith(("vitkit ", "python ", "srun ", "torchrun ")) or line.partition(":")[0] in \
                ("data", "time"):
            break
        prose.append(line)
    summary = " ".join(prose)
    if summary.endswith(":") and ". " in summary:  # a lead-in to the commands below it: the sentences before it
        summary = summary[: summary.rindex(". ") + 1]
    return RecipeInfo(summary, _hardware(text), fields.get("data", ""), fields.get("time", ""))


def _hardware(text: str) -> str:
    """"8 GPUs", "2 nodes x 8 GPUs", "1 GPU", "CPU or 1 GPU", "CPU or GPUs": from the trainer's accelerator, devices
    and num_nodes."""
    def value(key: str) -> str:
        found = re.search(rf"^  {key}:\s*([^#\s]+)", text, re.M)
        return found.group(1) if found else ""

    accelerator, devices, nodes = value("accelerator") or "auto", value("devices") or "auto", value("num_nodes") or "1"
    gpus = "GPUs" if devices == "auto" else f"{devices} GPU" + ("s" if devices != "1" else "")
    if nodes not in ("1", ""):
        gpus = f"{nodes} nodes x {gpus}"
    return gpus + " (GPU only)" if accelerator == "gpu" else f"CPU or {gpus}"


def is_name(config: str) -> bool:
    """Whether a ``--config`` value is a bare name to look up (not a file that exists, a path or inline content)."""
    return re.fullmatch(r"[\w.-]+", config) is not None and not Path(config).exists()


def find(name: str) -> Path | None:
    """The file of recipe ``name`` (``vit_tiny_digits`` or ``vit_tiny_digits.yaml``), or None."""
    path = recipes_dir() / (name if name.endswith((".yaml", ".yml")) else f"{name}.yaml")
    return path if path.is_file() else None
