"""The recipe pieces: weight-decay groups, layer-wise LR decay, the schedules, EMA."""

import pytest
import torch

import vitkit
from vitkit.lit import EMA
from vitkit.training.optim import build_adamw, inverse_sqrt, layer_ids, param_groups, warmup_cosine, warmup_poly
from vitkit.training.recipe import Recipe, WarmupSchedule


def test_no_weight_decay_on_norms_biases_positions_and_tokens():
    m = vitkit.create_model("vit_tiny_patch16_224", depth=2)
    groups = param_groups(m, weight_decay=0.05)
    no_decay = {n for g in groups if g["weight_decay"] == 0 for n in g["names"]}
    decay = {n for g in groups if g["weight_decay"] > 0 for n in g["names"]}
    assert {"pos_embed", "cls_token", "blocks.0.norm1.weight", "blocks.0.attn.qkv.bias", "head.bias"} <= no_decay
    assert {"blocks.0.attn.qkv.weight", "blocks.1.mlp.fc1.weight", "patch_embed.proj.weight", "head.weight"} <= decay
    s = vitkit.create_model("swin_tiny_patch4_window7_224", depths=(2, 2), num_heads=(1, 2), embed_dim=16)
    no_decay = {n for g in param_groups(s, 0.05) if g["weight_decay"] == 0 for n in g["names"]}
    assert "layers.0.blocks.0.attn.relative_position_bias_table" in no_decay


def test_layer_decay_scales_lr_from_head_to_embeddings():
    m = vitkit.create_model("vit_tiny_patch16_224", depth=4)
    scale = {n: g["lr_scale"] for g in param_groups(m, 0.05, layer_decay=0.5) for n in g["names"]}
    assert scale["head.weight"] == 1.0
    assert scale["blocks.3.mlp.fc1.weight"] == 0.5
    assert scale["blocks.0.attn.qkv.weight"] == 0.5**4
    assert scale["patch_embed.proj.weight"] == scale["pos_embed"] == 0.5**5
    assert scale["norm.weight"] == scale["blocks.3.mlp.fc1.weight"]  # the final norm goes with the last block
    s = vitkit.create_model("swin_tiny_patch4_window7_224", embed_dim=24)
    ids = layer_ids(s)
    assert ids["patch_embed.proj.weight"] == 0 and ids["layers.0.blocks.0.attn.qkv.weight"] == 1
    assert ids["layers.2.blocks.1.attn.qkv.weight"] == 6
    # patch merging goes with the first block of its stage (timm's group_matcher)
    assert ids["layers.2.downsample.reduction.weight"] == ids["layers.2.blocks.0.attn.qkv.weight"] == 5
    assert ids["head.fc.weight"] == 13 and ids["norm.weight"] == 12
    opt = build_adamw(m, lr=1e-3, weight_decay=0.05, betas=(0.9, 0.999), layer_decay=0.5)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(m.parameters()))



def test_lora_adapters_train_at_their_own_rate_without_layer_decay():
    """Adapters start from zero in every block: each gets lr x adapter_scale, the first block's as the last's,
    while the head keeps lr and the frozen weights are in no group."""
    pytest.importorskip("peft")
    from vitkit.models.lora import DEFAULT_TARGETS, LoraSettings, add_lora

    m = vitkit.create_model("vit_tiny_patch16_224", depth=4, img_size=32, num_classes=3)
    add_lora(m, LoraSettings(4, None, 0.0, list(DEFAULT_TARGETS), "qkv"))
    m.head.requires_grad_(True)
    scale = {n: g["lr_scale"] for g in param_groups(m, 0.05, layer_decay=0.5, adapter_scale=10.0) for n in g["names"]}
    adapters = [n for n in scale if ".lora_" in n]
    assert len(adapters) == 4 * 2 * 2 and {scale[n] for n in adapters} == {10.0}
    assert scale["head.weight"] == 1.0 and set(scale) == {*adapters, "head.weight", "head.bias"}


def test_adamw_is_fused_where_it_can_be_and_updates_as_the_loop_over_weights_does():
    """The fused kernel is the default (one kernel for every weight); given the same gradients for five steps,
    with weight decay groups and layer decay, it ends where torch's loop over weights ends. (Each model's own
    gradients would not do: Adam divides by the root of tiny second moments, so rounding apart grows.)"""
    torch.manual_seed(0)
    m = vitkit.create_model("vit_tiny_patch16_224", depth=2, img_size=32, patch_size=8, num_classes=3)
    twin = vitkit.create_model("vit_tiny_patch16_224", depth=2, img_size=32, patch_size=8, num_classes=3)
    twin.load_state_dict(m.state_dict())
    start = {k: v.clone() for k, v in m.state_dict().items()}
    fused = build_adamw(m, lr=1e-2, weight_decay=0.05, betas=(0.9, 0.95), layer_decay=0.75)
    loop = build_adamw(twin, lr=1e-2, weight_decay=0.05, betas=(0.9, 0.95), layer_decay=0.75, fused=False)
    assert all(g["fused"] for g in fused.param_groups) and not any(g["fused"] for g in loop.param_groups)
    x, y = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 0])
    for _ in range(5):
        torch.nn.functional.cross_entropy(m(x), y).backward()
        for a, b in zip(m.parameters(), twin.parameters(), strict=True):
            b.grad = a.grad.clone()
        for opt in (fused, loop):
            opt.step()
            opt.zero_grad(set_to_none=True)
    for (k, a), b in zip(m.state_dict().items(), twin.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=k)
        assert not torch.equal(a, start[k]), f"{k} did not move"


@pytest.mark.parametrize("precision,clip,fused", [
    ("32-true", 1.0, True), ("bf16-mixed", None, True), ("bf16-mixed", 1.0, False), ("16-mixed, scaled", None, False)])
def test_the_training_module_takes_the_loop_under_a_scaler_or_clipping_in_mixed_precision(precision, clip, fused):
    """A gradient scaler (fp16 on GPUs; CPU's 16-mixed has none) unscales the gradients before the step, which a
    fused optimizer does itself; Lightning's mixed precision refuses clipping with one, scaler or not. Elsewhere
    the fused kernel. Each trains a step as Lightning runs it."""
    import lightning.pytorch as L
    from lightning.pytorch.plugins import MixedPrecision

    from vitkit.lit import ImageClassifier, Recipe

    class Noise(torch.utils.data.Dataset):  # four random images, three classes
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return torch.randn(3, 32, 32), i % 3

    module = ImageClassifier("vit_tiny_patch16_224", num_classes=3, recipe=Recipe(lr=5e-4, weight_decay=0.05),
                             model_overrides={"depth": 1, "img_size": 32, "patch_size": 8})
    how = ({"plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]}
           if precision.endswith("scaled") else {"precision": precision})
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, gradient_clip_val=clip, max_steps=1, limit_val_batches=0, **how)
    before = module.model.head.weight.detach().clone()
    trainer.fit(module, torch.utils.data.DataLoader(Noise(), batch_size=4))
    assert all(bool(g["fused"]) == fused for g in trainer.optimizers[0].param_groups), precision
    assert trainer.global_step == 1 and not torch.equal(module.model.head.weight, before)

def test_warmup_then_cosine():
    lrs = [warmup_cosine(s, 10, 110, 0.01) for s in range(110)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:10], strict=False))
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False))
    assert lrs[60] == pytest.approx(0.01 + 0.99 * 0.5)
    assert warmup_cosine(110, 10, 110, 0.01) == pytest.approx(0.01)


def test_warmup_then_poly_is_mmsegmentations_poly_lr():
    """mmsegmentation's PolyLR after the warmup: (1 - progress) ** 0.9 of the way from 1 down to the floor."""
    lrs = [warmup_poly(s, 10, 110, 0.01) for s in range(111)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0) and lrs[10] == pytest.approx(1.0)
    assert all(a > b for a, b in zip(lrs[10:], lrs[11:], strict=False))
    assert lrs[60] == pytest.approx(0.01 + 0.99 * 0.5 ** 0.9) and lrs[110] == pytest.approx(0.01)
    schedule = WarmupSchedule(1.0, 0.01, "poly")
    assert schedule(5) == 1.0  # before fit gives the run's length
    schedule.set_length(110, max_epochs=11)  # 10 steps an epoch: one epoch of warmup
    assert [schedule(s) for s in range(110)] == pytest.approx(lrs[:110])
    with pytest.raises(ValueError, match="schedule must be one of cosine, poly, rsqrt, got 'step'"):
        WarmupSchedule(1.0, 0.0, "step")


def test_inverse_sqrt_peaks_at_warmup():
    vals = [inverse_sqrt(s, 4000) for s in range(0, 16000, 100)]
    peak = max(range(len(vals)), key=vals.__getitem__)
    assert vals[peak] == pytest.approx(1.0, abs=1e-3) and abs(peak * 100 - 4000) <= 100
    assert inverse_sqrt(15999, 4000) == pytest.approx(0.5)


def test_the_recipes_rsqrt_schedule_is_the_transformers_and_needs_no_length():
    """``schedule: rsqrt`` after ``warmup_steps`` gives Vaswani et al.'s multiplier before and after the run's
    length is known (a stream has none); after a warmup of epochs it waits for the length, as the others do."""
    schedule = Recipe(lr=7e-4, weight_decay=0.0, schedule="rsqrt", warmup_steps=400).multiplier()
    assert not schedule.needs_length
    expected = [inverse_sqrt(s, 400) for s in range(0, 2000, 50)]
    assert [schedule(s) for s in range(0, 2000, 50)] == pytest.approx(expected)
    schedule.set_length(100, max_epochs=1)  # a run shorter than the warmup keeps the warmup's length
    assert [schedule(s) for s in range(0, 2000, 50)] == pytest.approx(expected)
    by_epochs = Recipe(lr=1.0, weight_decay=0.0, schedule="rsqrt", warmup_epochs=1.0, min_lr=0.25).multiplier()
    assert by_epochs.needs_length and by_epochs(7) == 1.0
    by_epochs.set_length(100, max_epochs=10)  # 10 steps an epoch
    assert by_epochs(9) == pytest.approx(1.0) and by_epochs(39) == pytest.approx(0.5) and by_epochs(10**6) == 0.25
    cosine = Recipe(lr=1.0, weight_decay=0.0, warmup_steps=3, warmup_epochs=5.0).multiplier()
    cosine.set_length(100, max_epochs=10)
    assert cosine.warmup == 3  # the steps, not the epochs
    with pytest.raises(ValueError, match="warmup_steps must be an integer >= 0"):
        Recipe(lr=1.0, weight_decay=0.0, warmup_steps=-1)


def test_ema_tracks_weights():
    m = torch.nn.Linear(3, 2)
    ema = EMA(m, decay=0.9)
    w0 = m.weight.detach().clone()
    with torch.no_grad():
        m.weight.add_(1.0)
    ema.update(m)
    torch.testing.assert_close(ema.module.weight, w0 + 0.1)
    assert not any(p.requires_grad for p in ema.parameters())


def test_head_epochs_hold_the_backbone_still_then_warm_it_up(tmp_path):
    """``head_epochs``: the backbone's groups stay at LR 0 (its weights unchanged, the head learning) for the first
    epochs, then warm up into the schedule; a module without a backbone and head refuses it in one line."""
    import lightning as L

    from tests.tasks.detection_scenes import write_coco
    from vitkit.data.modules.detection import DetectionDataModule
    from vitkit.errors import UsageError
    from vitkit.lit import Detector

    schedule = WarmupSchedule(1.0, 0.0, head_epochs=2.0)
    schedule.set_length(10, 5)  # 2 steps an epoch: 4 held, then 2 of warmup
    assert [schedule.held(s) for s in range(4)] == [0.0] * 4
    assert schedule.held(4) == pytest.approx(0.5 * schedule(4)) and schedule.held(6) == schedule(6) > 0
    root = write_coco(tmp_path, {"train": 4, "val": 2})
    recipe = Recipe(lr=1e-3, weight_decay=0.0, warmup_epochs=1.0, head_epochs=1.0)
    module = Detector("vit_tiny_patch16_224", num_classes=10, img_size=64, det_tokens=4, recipe=recipe,
                      model_overrides={"patch_size": 16, "embed_dim": 32, "depth": 2, "num_heads": 2})
    start = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    seen = {}

    class Watch(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):  # held: no backbone gradient computed
            grads = seen.setdefault(f"grads_{trainer.current_epoch}", set())
            grads.update(n.partition(".")[0] for n, p in pl_module.model.named_parameters() if p.grad is not None)

        def on_train_epoch_end(self, trainer, pl_module):
            seen[trainer.current_epoch] = {n: not torch.equal(p, start[n]) for n, p in
                                           pl_module.model.named_parameters()}

    trainer = L.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Watch()],
                        num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(module, DetectionDataModule(str(root), img_size=64, batch_size=2, num_workers=0))
    moved = seen[0]
    assert not any(v for n, v in moved.items() if n.startswith("backbone.")), "the backbone moved while held"
    assert moved["class_head.layers.0.weight"] and moved["det_token"]  # the head learned
    assert all(v for n, v in seen[1].items() if n.startswith("backbone.blocks."))  # then the backbone did
    assert "backbone" not in seen["grads_0"] and "backbone" in seen["grads_1"], seen
    classifier = vitkit.lit.ImageClassifier("vit_tiny_patch16_224", num_classes=3, recipe=recipe,
                                       model_overrides={"depth": 1, "embed_dim": 32, "num_heads": 2})
    with pytest.raises(UsageError, match="ImageClassifier takes no recipe.head_epochs"):
        classifier.configure_optimizers()
