"""Building a model whose every weight is then replaced (a strict load of another library's state dict, or shapes
read on the meta device) without drawing the weights first: the initialisers of ``torch.nn.init`` and timm's
truncated normal left out for the duration."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

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
