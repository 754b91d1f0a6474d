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


def test_a_lightning_training_step_reads_nothing_back_to_the_host(tmp_path):
    """The training module's step (loss, the deferred non-finite check, the epoch loss's update, logging between
    logging steps) on a GPU, as Lightning runs it: no step but the logging steps reads a value back."""
    import lightning as L

    from vitkit.lit import DigitsDataModule, ImageClassifier, Recipe

    module = ImageClassifier("vit_tiny_patch16_224", model_overrides=dict(img_size=32, patch_size=8, depth=2),
                             num_classes=10, pretrained=False, recipe=Recipe(lr=5e-4, weight_decay=0.05))
    step = module.training_step
    checked = []

    def strict_step(batch, batch_idx):
        logging_step = module.global_step % module.trainer.log_every_n_steps == 0
        torch.cuda.set_sync_debug_mode("default" if logging_step else "error")
        try:
            return step(batch, batch_idx)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            checked.append(not logging_step)

    module.training_step = strict_step
    trainer = L.Trainer(accelerator="gpu", devices=1, max_steps=12, log_every_n_steps=5, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, limit_val_batches=0,
                        default_root_dir=tmp_path)
    trainer.fit(module, DigitsDataModule(img_size=32, batch_size=32))
    assert sum(checked) >= 8
