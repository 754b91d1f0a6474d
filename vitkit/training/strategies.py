"""FSDP2 for large models, as a strategy a config names: Lightning's ``ModelParallelStrategy`` with data-parallel
sharding only, per-block options, and sharded checkpoints written atomically."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy, StrategyRegistry

from vitkit.errors import UsageError


class FSDP2Strategy(ModelParallelStrategy):
    """FSDP2: each rank holds a shard of every block.

    Each block's parameters, gradients and optimizer state are sharded (``fully_shard`` on DTensors); vitkit's
    LightningModules shard their model in ``configure_model``. Runs on GPUs (NCCL) and on CPU processes (gloo). On one
    node the model is sharded over all its processes; on several, over the processes of each node and replicated across
    nodes (hybrid sharding), with every rank reading its own data.

    Args:
        activation_checkpointing: recompute each block's activations in backward, to save memory.
        compile_blocks: ``torch.compile`` each block in place before sharding it.
        save_distributed_checkpoint: each rank writes its own shard (torch's distributed checkpoint, a folder);
            False gathers one full file on rank 0.
    """

    def __init__(self, activation_checkpointing: bool = False, compile_blocks: bool = False,
                 save_distributed_checkpoint: bool = True, **kwargs: Any) -> None:
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint, **kwargs)
        self.block_options = dict(activation_checkpointing=activation_checkpointing, compile_blocks=compile_blocks)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every rank reads its own part of the data: the mesh's second dimension shards the model within a
        node (vitkit applies no tensor parallelism), it does not share data."""
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        """Written beside the target and moved into place when every rank has written: a process killed during
        a save leaves the previous checkpoint whole."""
        path = Path(self.broadcast(str(filepath)))
        tmp = path.with_name(path.name + ".saving")
        if self.is_global_zero:  # saves are collective and one at a time: any other one was cut short
            settle_interrupted_saves(path.parent)
        self.barrier("vitkit_save_start")
        super().save_checkpoint(checkpoint, tmp, storage_options)
        self.barrier("vitkit_save_written")
        if self.is_global_zero:  # two renames; between them only the previous checkpoint (".old") is whole
            old = path.with_name(path.name + ".old")
            _remove(old)
            if path.exists():
                path.replace(old)
            tmp.replace(path)
            _remove(old)
        self.barrier("vitkit_save_done")

    def remove_checkpoint(self, filepath) -> None:
        if self.is_global_zero:
            _remove(Path(filepath))


def settle_interrupted_saves(folder: str | Path) -> None:
    """Put back in place what a save killed in ``folder`` left: between the two renames of
    :meth:`FSDP2Strategy.save_checkpoint`, ``NAME`` is missing while ``NAME.old`` (the previous checkpoint) and
    ``NAME.saving`` (the new one, complete: it is moved only after every rank has written) are whole; the new one
    takes the name. A ``NAME.saving`` beside a ``NAME`` was cut short and is removed. vitkit's CLI calls this on
    every process before ``--ckpt_path last`` is looked up (the nodes of a job that share the folder start
    unsynchronised, before any process group): each move is one rename that only one of them can make, and the
    folder ends the same whichever makes it. A Trainer of your own can call it before ``fit``."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    for old in folder.glob("*.old"):
        path = old.with_name(old.name[:-len(".old")])
        saving = path.with_name(path.name + ".saving")
        if not path.exists():
            _move_unless_taken(saving if saving.exists() else old, path)
        _remove(old)
    for stale in folder.glob("*.saving"):
        _remove(stale)


def _move_unless_taken(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst`` unless another process did (``src`` gone) or filled ``dst`` first: a folder is
    not renamed onto a non-empty one, and a file is hard-linked, which fails where ``dst`` exists (renamed where
    the file system has no hard links)."""
    try:
        if src.is_dir():
            src.rename(dst)
            return
        try:
            os.link(src, dst)
        except OSError as e:
            if e.errno in (errno.EEXIST, errno.ENOENT):
                raise
            src.replace(dst)
            return
        src.unlink(missing_ok=True)
    except OSError as e:
        if e.errno not in (errno.ENOENT, errno.EEXIST, errno.ENOTEMPTY):
            raise


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)  # another process may be removing it too
    else:
        path.unlink(missing_ok=True)


class BlockFSDPStrategy(FSDPStrategy):
    """Retired: vitkit's large-model path is FSDP2 (:class:`FSDP2Strategy`), which runs on CPU processes too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # a Strategy, so that a recipe naming it gets here
        raise UsageError("vitkit.lit.strategies.BlockFSDPStrategy (FSDP1) is retired; use FSDP2 in its place: "
                         "`strategy: {class_path: vitkit.lit.FSDP2Strategy, init_args: "
                         "{activation_checkpointing: true}}` (see configs/vit_large_in1k_fsdp.yaml)")


# `--trainer.strategy fsdp2` (and `strategy: fsdp2` in a recipe), as Lightning's own strategies register their
# names; once per process, when vitkit.lit is imported
if "fsdp2" not in StrategyRegistry:
    StrategyRegistry.register("fsdp2", FSDP2Strategy, description="vitkit's FSDP2: every block sharded")
    StrategyRegistry.register("fsdp2_activation_checkpointing", FSDP2Strategy, activation_checkpointing=True,
                              description="vitkit's FSDP2 with each block's activations recomputed in backward")
