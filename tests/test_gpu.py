"""Checks that need a CUDA device (`pytest -m gpu`, run by benchmarks/gpu_check.sh); skipped elsewhere."""

import pytest
import torch

import vitkit

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("name, kw", [
    ("vit_tiny_patch16_224", dict(img_size=32, patch_size=8, depth=2)),
    ("swin_tiny_patch4_window7_224", dict(img_size=32, embed_dim=16, depths=(1, 1), num_heads=(1, 2), window_size=4)),
])
def test_a_training_step_makes_no_host_sync(name, kw):
    """The input checks (finiteness included) read nothing back to the host on a GPU."""
    model = vitkit.create_model(name, num_classes=3, **kw).cuda()
    x = torch.randn(4, 3, 32, 32, device="cuda")
    model(x).sum().backward()  # warm-up: lazy initialisation may sync once
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(x).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
