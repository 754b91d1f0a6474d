"""The recipe pieces: weight-decay groups, layer-wise LR decay, the schedules, EMA."""

import pytest
import torch

import vitkit
from vitkit.lit import EMA
from vitkit.lit.optim import build_adamw, inverse_sqrt, layer_ids, param_groups, warmup_cosine


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


def test_warmup_then_cosine():
    lrs = [warmup_cosine(s, 10, 110, 0.01) for s in range(110)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:10], strict=False))
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False))
    assert lrs[60] == pytest.approx(0.01 + 0.99 * 0.5)
    assert warmup_cosine(110, 10, 110, 0.01) == pytest.approx(0.01)


def test_inverse_sqrt_peaks_at_warmup():
    vals = [inverse_sqrt(s, 4000) for s in range(0, 16000, 100)]
    peak = max(range(len(vals)), key=vals.__getitem__)
    assert vals[peak] == pytest.approx(1.0, abs=1e-3) and abs(peak * 100 - 4000) <= 100
    assert inverse_sqrt(15999, 4000) == pytest.approx(0.5)


def test_ema_tracks_weights():
    m = torch.nn.Linear(3, 2)
    ema = EMA(m, decay=0.9)
    w0 = m.weight.detach().clone()
    with torch.no_grad():
        m.weight.add_(1.0)
    ema.update(m)
    torch.testing.assert_close(ema.module.weight, w0 + 0.1)
    assert not any(p.requires_grad for p in ema.parameters())
