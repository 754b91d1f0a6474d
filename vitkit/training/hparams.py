"""What a vitkit LightningModule carries through a checkpoint: its own hyper-parameters, the config its model was
built with, every rank's random streams."""

from __future__ import annotations

import dataclasses
import inspect
import random
from typing import Any

import lightning as L
import numpy as np
import torch
from torch import nn

from vitkit.distributed import gather_from_ranks


def read_hparams(path: Any, key: str = "hyper_parameters") -> dict:
    """A checkpoint file's hyper-parameters (or its data module's, ``key="datamodule_hyper_parameters"``), read
    without its tensors ({} where it has none, or where it is not a file torch reads safely: loading it then says
    what is wrong)."""
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - whoever loads the file next names the fault
        return {}
    return dict(raw.get(key) or {}) if isinstance(raw, dict) else {}


def keep_own_hparams(module: L.LightningModule) -> None:
    """Drop hyper-parameters that are not arguments of the module's ``__init__``.

    The CLI links what any data module offers (classes, vocabularies) into whichever module the config
    names; a module keeps only what it takes, so its checkpoint records nothing foreign."""
    own = inspect.signature(type(module).__init__).parameters
    module.remove_ignored_hparams([k for k in module.hparams if k not in own and not k.startswith("_")])


# -- random streams per rank -------------------------------------------------------------------------
# Shuffling, augmentation, mixup and drop path draw from the global generators. Each rank gets its own
# stream (seed + rank, as timm's train script does), and a checkpoint keeps every rank's state, so a
# resumed run draws what the uninterrupted run would have drawn, on every rank.


def seed_rank(trainer: L.Trainer) -> None:
    """Offset the global generators by the rank (rank 0 keeps the seed it had)."""
    if trainer.world_size > 1 and trainer.global_rank > 0:
        seed = torch.initial_seed() + trainer.global_rank
        torch.manual_seed(seed)
        np.random.seed(seed % 2**32)
        random.seed(seed)


def rng_state() -> dict:
    """The global generators' state as plain tensors and ints, so ``weights_only`` loading accepts it."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss)}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    random.setstate(state["python"])


def gather_rng_states(trainer: L.Trainer) -> list[dict]:
    """Every rank's generator states, in rank order (a collective: every rank calls it while saving)."""
    return gather_from_ranks(trainer, rng_state())


def restore_rng_states(trainer: L.Trainer, states: list[dict] | dict) -> None:
    """This rank's state; a run resumed on a different number of ranks reuses them in turn."""
    states = [states] if isinstance(states, dict) else states  # checkpoints before per-rank states
    set_rng_state(states[trainer.global_rank % len(states)])


def record_config(model: nn.Module, hp: dict[str, Any]) -> None:
    """Record in ``model_overrides`` every config field of ``model`` that differs from its preset's: the shapes a
    backbone file gave it are then in the checkpoint, which rebuilds the model without that file."""
    from vitkit.models.registry import preset_config

    cfg, preset = dataclasses.asdict(model.cfg), dataclasses.asdict(preset_config(model.name))
    own = dict(hp.get("model_overrides") or {})
    own.update({k: v for k, v in cfg.items() if k not in ("num_classes", "img_size") and v != preset.get(k)})
    hp["model_overrides"] = own
