"""What a model costs: multiply-accumulates with PyTorch's own FLOP counter, on the meta device (no memory, no
compute), and the activations a forward keeps for the backward pass."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ..models.config import pair


def count_gmacs_of(factory: Callable[[], nn.Module], input_shape: tuple[int, ...], train: bool = False) -> float:
    """GMACs per sample (FLOPs / 2, as timm and the papers report) of a model built by ``factory``.

    The model is built on the meta device, so even giant models cost nothing to count. With ``train``
    the backward pass is counted too (about 3x the forward)."""
    with torch.device("meta"):
        model = factory().train(train)
        x = torch.empty(1, *input_shape, requires_grad=train)
    with torch.set_grad_enabled(train), FlopCounterMode(display=False) as counter:
        out = model(x)
        if train:
            out.float().sum().backward()
    return counter.get_total_flops() / 2 / 1e9


def count_gmacs(model: nn.Module, img_size: int | tuple[int, int] | None = None) -> float:
    """GMACs of one forward pass of one image through a vitkit model (rebuilt from its config on meta)."""
    cfg = model.cfg
    return count_gmacs_of(lambda: type(model)(cfg), (cfg.in_chans, *pair(img_size or cfg.img_size)))


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def saved_activations_mib(model: nn.Module, x: torch.Tensor) -> float:
    """MiB of the distinct tensors autograd keeps for the backward pass of one forward of ``x`` (each storage
    once; weights saved for their matmuls included: the difference between two batch sizes leaves them out)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(seen.values()) / 2**20
