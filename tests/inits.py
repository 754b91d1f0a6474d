"""Models whose every saved tensor is loaded next, built without drawing weights first: on the meta device, then
given empty storage (PyTorch's own route for a model about to be loaded). Their computed buffers (sin-cos positions,
Swin's planned windows) are computed again by their load hooks, so the load that follows must be strict."""

from __future__ import annotations

import torch


def weightless(build, *args, **kwargs) -> torch.nn.Module:
    """``build(*args, **kwargs)`` on the meta device, then on the CPU with uninitialised storage."""
    with torch.device("meta"):
        model = build(*args, **kwargs)
    return model.to_empty(device="cpu")


def timm_shapes_model(name: str, **kwargs) -> torch.nn.Module:
    """timm's model ``name`` built on the meta device (timm's ``device`` argument), for its state dict's names and
    shapes: ViT and Swin skip their weight init (timm's ``weight_init="skip"``); timm's other classes take no such
    argument (or, NaFlexViT, no "skip") and draw theirs."""
    import timm

    try:
        return timm.create_model(name, pretrained=False, weight_init="skip", device="meta", **kwargs)
    except (TypeError, AssertionError) as e:  # NaFlexViT takes the argument, and asserts it is a real scheme
        if isinstance(e, TypeError) and "weight_init" not in str(e):
            raise
        return timm.create_model(name, pretrained=False, device="meta", **kwargs)
