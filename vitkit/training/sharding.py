"""FSDP2 for vitkit's models: every transformer block its own shard unit, then the root, on the data-parallel mesh
of Lightning's ``ModelParallelStrategy``; and the check that no rank trains with unsynchronised gradients."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from vitkit.errors import UsageError
from vitkit.layers import Block

# Lightning's precision names -> FSDP2's policy: parameters gathered in the low precision, gradients reduced in
# float32. Anything else (32-true, the *-true precisions Lightning converts the module to) gathers as stored.
_POLICIES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def mixed_precision(precision: str) -> MixedPrecisionPolicy:
    dtype = _POLICIES.get(str(precision))
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)


def shard(model: nn.Module, mesh, precision: str = "32-true", *, activation_checkpointing: bool = False,
          compile_blocks: bool = False) -> nn.Module:
    """``fully_shard`` each :class:`vitkit.layers.Block` (all-gathered one block at a time in forward and
    backward), then the root, which holds what is left (embeddings, final norm, head). Options: recompute each
    block's activations in backward (the model's ``set_grad_checkpointing``), and compile each block in place
    (parameter names, and so checkpoints, stay those of the plain model). A model's ``forward_methods`` (a
    segmenter's ``forward_train``) are entry points that gather the root's weights as ``forward`` does."""
    policy = mixed_precision(precision)
    if activation_checkpointing:
        if not hasattr(model, "set_grad_checkpointing"):
            raise UsageError(f"{type(model).__name__} has no per-block activation checkpointing "
                             "(set_grad_checkpointing); turn activation_checkpointing off")
        model.set_grad_checkpointing(True)
    for module in model.modules():
        if isinstance(module, Block):
            if compile_blocks:
                module.compile()
            fully_shard(module, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for name in getattr(model, "forward_methods", ()):  # other entry points gather the root's weights as forward does
        register_fsdp_forward_method(model, name)
    return model


@contextmanager
def gathered(model: nn.Module) -> Iterator[None]:
    """Inside, every FSDP2 unit of ``model`` holds its full parameters and keeps them from one forward to the next,
    so ranks may run different numbers of forwards (decoding that stops when its batch is done) without the
    collectives of a gather per forward. Entering and leaving are collectives: every rank must do both."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(True, recurse=False)


def data_parallel_mesh(module: L.LightningModule):
    """The mesh FSDP2 shards over, from ``ModelParallelStrategy``'s (data_parallel, tensor_parallel) mesh; vitkit
    applies no tensor parallelism, so a dimension of size 1 is dropped and the other one shards. With both
    larger than 1 (several nodes under :class:`~vitkit.training.strategies.FSDP2Strategy`) the 2-D mesh gives hybrid
    sharding: replicated across the first dimension (nodes), sharded within the second (the processes of a
    node); every rank's gradients are averaged either way."""
    mesh = module.device_mesh
    names = mesh.mesh_dim_names or ()
    if names != ("data_parallel", "tensor_parallel"):
        return mesh
    dp, tp = mesh["data_parallel"], mesh["tensor_parallel"]
    if tp.size() == 1:
        return dp
    return tp if dp.size() == 1 else mesh


def check_gradients_sync(trainer: L.Trainer, model: nn.Module) -> None:
    """Refuse, before the first step, a run whose ranks would train apart: more than one rank under a strategy
    that neither wraps the model in DDP / FSDP nor finds every trainable parameter sharded (a DTensor)."""
    if trainer.world_size <= 1:
        return
    strategy = trainer.strategy
    if isinstance(strategy, (DDPStrategy, FSDPStrategy)):
        return
    if isinstance(strategy, ModelParallelStrategy):
        plain = [n for n, p in model.named_parameters() if p.requires_grad and not isinstance(p, DTensor)]
        if not plain:
            return
        raise RuntimeError(
            f"{type(strategy).__name__} on {trainer.world_size} ranks, but {len(plain)} trainable parameter(s) are "
            f"not sharded (first: {plain[0]}): their gradients would not be synchronised and the ranks would train "
            "apart. Apply `fully_shard` to them in `configure_model` (vitkit's modules do: vitkit.training.sharding)")
