"""Building a model whose every weight is then replaced (a strict load of another library's state dict, or shapes
read on the meta device) without drawing the weights first: the initialisers of ``torch.nn.init`` and timm's
truncated normal left out for the duration. And building the reference model of a comparison with its library's
own initialisation, drawn faster (:func:`reference_model`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch

INITS = ["trunc_normal_", "normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
         "xavier_normal_", "zeros_", "ones_", "constant_"]


def _keep(t, *args, **kwargs):
    return t


@contextlib.contextmanager
def skipped_inits() -> Iterator[None]:
    """Within it, ``torch.nn.init``'s initialisers and timm's ``_trunc_normal_`` return their tensor as it is
    (uninitialised memory, or a meta tensor). Only for a model whose parameters are all overwritten next."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch("timm.layers.weight_init._trunc_normal_", _keep))
        for name in INITS:
            stack.enter_context(mock.patch(f"torch.nn.init.{name}", _keep))
        yield


# A model built as the reference of a comparison (timm's, torchvision's) keeps its library's initialisation, drawn
# faster: nn.Linear's default draw, which timm's ViT and Swin then replace for every Linear, took a third of the time
# their full-size builds spent drawing, and a truncated normal draws four passes where a normal draws one.
TAIL = 6.0  # bounds this many standard deviations away or more: a clamped normal differs by under 2e-9 of the mass


def _fast_trunc_normal(original):
    def draw(tensor, mean=0.0, std=1.0, a=-2.0, b=2.0, *args, **kwargs):
        if args or kwargs or a - mean > -TAIL * std or b - mean < TAIL * std:
            return original(tensor, mean, std, a, b, *args, **kwargs)
        with torch.no_grad():
            return tensor.normal_(mean, std).clamp_(a, b)
    return draw


def _nan_linear(self) -> None:
    with torch.no_grad():
        self.weight.fill_(float("nan"))
        if self.bias is not None:
            self.bias.fill_(float("nan"))


def reference_model(build, *args, **kwargs) -> torch.nn.Module:
    """``build(*args, **kwargs)`` (``timm.create_model``, a torchvision builder) with its library's initialisation
    drawn faster (see above). A Linear the library leaves at PyTorch's default draw (still not a number: the fill
    is whole, so its first element tells) is given that draw afterwards; a bias left beside a drawn weight is an
    error."""
    import timm.layers.weight_init as timm_init

    with contextlib.ExitStack() as stack:
        for owner in (timm_init, torch.nn.init):  # timm's draw, and PyTorch's that torchvision calls
            name = "_trunc_normal_" if owner is timm_init else "trunc_normal_"
            stack.enter_context(mock.patch.object(owner, name, _fast_trunc_normal(getattr(owner, name))))
        stack.enter_context(mock.patch.object(torch.nn.Linear, "reset_parameters", _nan_linear))
        model = build(*args, **kwargs)
    for name, m in model.named_modules():
        if not isinstance(m, torch.nn.Linear) or not m.weight.numel():
            continue
        if m.weight.view(-1)[0].isnan():
            m.reset_parameters()
        assert m.bias is None or not m.bias.numel() or not m.bias[0].isnan(), f"{name}: weight drawn, bias left"
    return model
