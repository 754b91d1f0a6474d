"""Which attention backends the tests can compare on this machine."""

import pytest

from vitkit.layers.attention import flex_runs_on_cpu

# flex attention is compiled by torch.compile, which builds it only for CPUs with AVX2 or better; elsewhere
# vitkit falls back to sdpa (tests/layers/test_attention.py checks that), and the flex comparisons skip.
FLEX = flex_runs_on_cpu()
needs_flex = pytest.mark.skipif(not FLEX, reason="torch.compile builds flex attention only for CPUs with AVX2")
BACKENDS = ("sdpa", "math", "flex") if FLEX else ("sdpa", "math")
