"""FSDP for large models: shard every transformer block, optionally checkpoint its activations."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import FSDPStrategy

from vitkit.layers import Block


class BlockFSDPStrategy(FSDPStrategy):
    """Lightning's FSDP with each :class:`vitkit.layers.Block` as its own shard unit, so a config can name it
    by class path (``strategy: {class_path: vitkit.lit.strategies.BlockFSDPStrategy}``)."""

    def __init__(self, sharding_strategy: str = "FULL_SHARD", activation_checkpointing: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(auto_wrap_policy={Block}, sharding_strategy=sharding_strategy,
                         activation_checkpointing_policy={Block} if activation_checkpointing else None, **kwargs)
