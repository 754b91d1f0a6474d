"""A real Hugging Face hub cache in a temporary folder, for tests of pretrained weights by name."""

from pathlib import Path

import torch
from huggingface_hub import constants
from safetensors.torch import save_file

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def write_hub_repo(cache: Path, repo_id: str, files: dict[str, Path]) -> Path:
    """The cache layout huggingface_hub reads: models--org--name/refs/main and snapshots/<commit>/<files>."""
    folder = cache / f"models--{repo_id.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / "main").write_text(COMMIT)
    snap = folder / "snapshots" / COMMIT
    snap.mkdir(parents=True, exist_ok=True)
    for name, src in files.items():
        (snap / name).write_bytes(src.read_bytes())
    return snap


def cache_weights(cache: Path, tag: str, model: torch.nn.Module, scratch: Path) -> Path:
    """``model``'s weights as timm's hub repo of ``tag`` (timm/<tag>/model.safetensors)."""
    path = scratch / "model.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)
    return write_hub_repo(cache, f"timm/{tag}", {"model.safetensors": path})


def use_offline_cache(monkeypatch, cache: Path) -> None:
    """Point huggingface_hub (and so timm and vitkit) at ``cache``, offline."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
