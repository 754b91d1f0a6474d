"""Which attention backends the tests can compare on this machine."""

import pytest

from vitkit.layers.attention import flex_runs_on_cpu

# flex attention is compiled by torch.compile, which builds it only for CPUs with AVX2 or better; elsewhere
# vitkit falls back to sdpa (tests/layers/test_attention.py checks that), and the flex comparisons skip.
FLEX = flex_runs_on_cpu()
needs_flex = pytest.mark.skipif(not FLEX, reason="torch.compile builds flex attention only for CPUs with AVX2")
BACKENDS = ("sdpa", "math", "flex") if FLEX else ("sdpa", "math")


def compiled_training_step_matches_eager(model, x, backend: str = "inductor") -> None:
    """``torch.compile(model, fullgraph=True, backend=backend)`` (a graph break is an error) trains like the eager
    model: a training step (train mode, drop path on, cross-entropy, backward) gives the eager loss and gradients."""
    import torch
    from torch.testing import assert_close

    y = torch.arange(len(x)) % model.num_classes
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    grads, losses = [], []
    with torch._inductor.config.patch(fallback_random=True):  # the eager RNG: the same drop-path draws
        for net in (model, compiled):
            model.zero_grad(set_to_none=True)
            torch.manual_seed(0)
            loss = torch.nn.functional.cross_entropy(net.train()(x), y)
            loss.backward()
            losses.append(loss.detach())
            grads.append({n: p.grad for n, p in model.named_parameters()})
    assert_close(losses[1], losses[0], atol=1e-5, rtol=1e-5)
    for n, g in grads[0].items():
        assert_close(grads[1][n], g, atol=1e-5, rtol=1e-4, msg=n)
