"""The class path recipes written before ``vitkit.training`` name FSDP2 by (``vitkit.lit.strategies.FSDP2Strategy``)
and the retired FSDP1 strategy's refusal."""

from vitkit.training.strategies import BlockFSDPStrategy, FSDP2Strategy

__all__ = ["BlockFSDPStrategy", "FSDP2Strategy"]
