"""timm's model interface on vitkit's ViT and Swin: each method against timm's own, on the same weights."""

import re

import pytest
import timm
import torch
from timm.optim import param_groups_layer_decay
from torch.testing import assert_close

import vitkit
from vitkit.checkpoints.formats import to_vitkit
from vitkit.training.optim import param_groups

# tiny configs both libraries build; the Swin one has three stages and windows that shrink at the last
VIT_KW = dict(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=3, num_classes=10)
VIT_REG_KW = dict(VIT_KW, class_token=False, reg_tokens=2, no_embed_class=True, global_pool="avg")
SWIN_KW = dict(img_size=64, embed_dim=32, depths=(2, 2, 2), num_heads=(2, 4, 4), window_size=4, num_classes=10)
CASES = {"vit": ("vit_tiny_patch16_224", VIT_KW), "vit_reg_avg": ("vit_tiny_patch16_224", VIT_REG_KW),
         "clip": ("vit_base_patch32_clip_quickgelu_224", VIT_KW), "siglip": ("vit_base_patch16_siglip_224", VIT_KW),
         "dinov3": ("vit_small_patch16_dinov3_qkvb", VIT_KW), "rope_ape": ("vit_small_patch16_rope_ape_224", VIT_KW),
         "rope_mixed": ("vit_small_patch16_rope_mixed_224", VIT_KW), "eva02": ("eva02_base_patch14_224", VIT_KW),
         "swin": ("swin_tiny_patch4_window7_224", SWIN_KW), "swinv2": ("swinv2_tiny_window8_256", SWIN_KW)}


def _pair(case: str, **extra):
    """(vitkit model, timm model) of one config, timm's weights randomised and copied into vitkit's."""
    name, kw = CASES[case]
    theirs = timm.create_model(name, **kw, **extra).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    ours = vitkit.create_model(name, **kw, **extra).eval()
    ours.load_state_dict(to_vitkit(theirs.state_dict())[0])  # Swin's index buffers dropped, Eva's names mapped
    return ours, theirs


def _distilled_pair():
    """DeiT distilled (its distillation token and second head) at the tiny ViT config, timm's weights copied."""
    theirs = timm.create_model("deit_tiny_distilled_patch16_224", **VIT_KW).eval()
    ours = vitkit.create_model("deit_tiny_distilled_patch16_224", **VIT_KW).eval()
    ours.load_state_dict(theirs.state_dict())
    return ours, theirs


def _x(size=None, batch=2, case="vit"):
    size = size or CASES[case][1]["img_size"]
    h, w = (size, size) if isinstance(size, int) else size
    return torch.randn(batch, 3, h, w, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("case", list(CASES))
def test_forward_features_and_pre_logits_match_timm(case):
    ours, theirs = _pair(case)
    x = _x(case=case)
    with torch.no_grad():
        assert_close(ours.forward_features(x), theirs.forward_features(x), atol=1e-5, rtol=0)
        f = ours.forward_features(x)
        assert_close(ours.forward_head(f, pre_logits=True), theirs.forward_head(theirs.forward_features(x),
                                                                                pre_logits=True), atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("pool", [None, "avg", ""])
def test_reset_classifier_matches_timm(case, pool):
    ours, theirs = _pair(case)
    if pool == "" and not case.startswith("swin"):
        pool = "token" if case == "vit" else "avg"
    ours.reset_classifier(0, pool)
    theirs.reset_classifier(0, pool)
    x = _x(case=case)
    with torch.no_grad():
        assert_close(ours(x), theirs(x), atol=1e-5, rtol=0)
    ours.reset_classifier(7)  # the pooling stays as set: none ('') keeps the map, one logit vector per position
    assert ours.num_classes == 7 and ours(x).shape[-1] == 7 and ours.get_classifier().out_features == 7
    assert ours(x).dim() == (4 if pool == "" else 2)
    assert ours.cfg.num_classes == 7


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kw", [dict(), dict(indices=2, norm=True), dict(indices=[0, -1], stop_early=True),
                                dict(indices=1, intermediates_only=True)])
def test_forward_intermediates_match_timm(case, kw):
    ours, theirs = _pair(case)
    x = _x(case=case)
    with torch.no_grad():
        a, b = ours.forward_intermediates(x, **kw), theirs.forward_intermediates(x, **kw)
    if not kw.get("intermediates_only"):
        assert_close(a[0], b[0], atol=1e-5, rtol=0)
        a, b = a[1], b[1]
    assert len(a) == len(b) > 0
    for u, v in zip(a, b, strict=True):
        assert_close(u, v, atol=1e-5, rtol=0)


def test_vit_intermediates_with_prefix_tokens_and_nlc_match_timm():
    ours, theirs = _pair("vit_reg_avg")
    x = _x()
    with torch.no_grad():
        for kw in (dict(return_prefix_tokens=True), dict(output_fmt="NLC")):
            a, b = ours.forward_intermediates(x, **kw)[1], theirs.forward_intermediates(x, **kw)[1]
            assert_close(a, b, atol=1e-5, rtol=0)


def _features(case: str, tmp_path, out_indices, **kw):
    """(vitkit, timm) features_only models built from one weights file of the same random model."""
    _, theirs = _pair(case)
    path = tmp_path / "w.pth"
    torch.save(theirs.state_dict(), path)
    name, cfg = CASES[case]
    timm_kw = {k: v for k, v in kw.items() if k != "output_fmt"}
    if kw.get("output_fmt") == "NCHW" and case == "swin":  # timm's 'getter' extractor gives NCHW maps
        timm_kw["feature_cls"] = "getter"
    theirs = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)),
                               features_only=True, out_indices=out_indices, **cfg, **timm_kw).eval()
    ours = vitkit.create_model(name, pretrained=str(path), features_only=True, out_indices=out_indices,
                               **cfg, **kw).eval()
    return ours, theirs


@pytest.mark.parametrize("fmt", ["NHWC", "NCHW"])
def test_swin_features_only_matches_timm(fmt, tmp_path):
    feat, timm_feat = _features("swin", tmp_path, (0, 2), output_fmt=fmt)
    x = _x(case="swin")
    with torch.no_grad():
        a, b = feat(x), timm_feat(x)
    assert [t.shape for t in a] == [t.shape for t in b]
    assert a[0].shape == ((2, 16, 16, 32) if fmt == "NHWC" else (2, 32, 16, 16))
    for u, v in zip(a, b, strict=True):
        assert_close(u, v, atol=1e-5, rtol=0)
    assert feat.feature_info.channels() == timm_feat.feature_info.channels() == [32, 128]
    assert feat.feature_info.reduction() == timm_feat.feature_info.reduction() == [4, 16]
    assert isinstance(feat.model.get_classifier(), torch.nn.Identity)  # pruned, as timm's


def test_swin_features_only_default_is_every_stage_nhwc_like_timm():
    feat = vitkit.create_model(CASES["swin"][0], features_only=True, **CASES["swin"][1])
    theirs = timm.create_model(CASES["swin"][0], features_only=True, **CASES["swin"][1])
    shapes = [t.shape for t in feat(_x(case="swin"))]
    assert shapes == [t.shape for t in theirs(_x(case="swin"))] == [(2, 16, 16, 32), (2, 8, 8, 64), (2, 4, 4, 128)]


def test_vit_features_only_matches_timm(tmp_path):
    feat, timm_feat = _features("vit", tmp_path, (1, 2))
    with torch.no_grad():
        a, b = feat(_x()), timm_feat(_x())
    assert len(a) == len(b) == 2 and len(feat.model.blocks) == 3
    for u, v in zip(a, b, strict=True):
        assert u.shape == (2, 48, 4, 4)
        assert_close(u, v, atol=1e-5, rtol=0)
    feat, _ = _features("vit", tmp_path, (0,))
    assert len(feat.model.blocks) == 1  # the blocks after the last one asked for are dropped
    deep = {**CASES["vit"][1], "depth": 5}
    default = vitkit.create_model(CASES["vit"][0], features_only=True, **deep)
    theirs = timm.create_model(CASES["vit"][0], features_only=True, **deep)
    assert default.out_indices == [2, 3, 4] and len(default(_x())) == len(theirs(_x())) == 3  # timm: the last 3


def test_features_only_refuses_a_format_it_cannot_give():
    with pytest.raises(ValueError, match="output_fmt must be one of"):
        vitkit.create_model(CASES["vit"][0], features_only=True, output_fmt="NHWC", **CASES["vit"][1])


@pytest.mark.parametrize("case", [*CASES, "deit_distilled"])
def test_group_matcher_gives_timms_layer_decay_groups(case):
    ours, theirs = _pair(case) if case in CASES else _distilled_pair()
    assert ours.group_matcher() == theirs.group_matcher()
    assert ours.group_matcher(coarse=True) == theirs.group_matcher(coarse=True)
    # layer-wise LR decay: every parameter gets the LR scale and weight decay timm's recipe gives it
    skip = theirs.no_weight_decay()
    ref = {n: (g["lr_scale"], g["weight_decay"]) for g in param_groups_layer_decay(
        theirs, weight_decay=0.05, no_weight_decay_list=skip, layer_decay=0.75)
        for n in g.get("param_names", [])}
    if not ref:  # timm versions without param_names: map back through parameter identity
        names = {id(p): n for n, p in theirs.named_parameters()}
        ref = {names[id(p)]: (g["lr_scale"], g["weight_decay"]) for g in param_groups_layer_decay(
            theirs, weight_decay=0.05, no_weight_decay_list=skip, layer_decay=0.75) for p in g["params"]}
    for pattern, repl in ((r"gamma_(\d)$", r"ls\1.gamma"), (r"attn\.[qkv]_proj\.weight$", "attn.qkv.weight"),
                          (r"attn\.([qv])_proj\.bias$", r"attn.\1_bias")):  # timm's Eva names, as converted
        ref = {re.sub(pattern, repl, n): v for n, v in ref.items()}
    got = {n: (g["lr_scale"], g["weight_decay"]) for g in param_groups(ours, 0.05, 0.75) for n in g["names"]}
    assert got.keys() == ref.keys()
    for n in ref:
        assert got[n][0] == pytest.approx(ref[n][0]), n
        assert got[n][1] == ref[n][1], n


@pytest.mark.parametrize("case", ["vit", "siglip", "dinov3", "swin", "swinv2"])
def test_grad_checkpointing_gives_the_same_gradients(case):
    ours, _ = _pair(case)
    x = _x(case=case)
    grads = []
    for enable in (False, True):
        ours.zero_grad()
        ours.set_grad_checkpointing(enable)
        ours.train()
        torch.manual_seed(0)
        ours(x).square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in ours.named_parameters()})
    for n in grads[0]:
        assert_close(grads[1][n], grads[0][n], atol=1e-6, rtol=1e-5)


def test_grad_checkpointing_recomputes_blocks_in_backward():
    """The blocks run a second time during backward (their activations were not kept). Hooked on a layer
    inside the block: the recomputation stops as soon as it has what backward needs."""
    ours, _ = _pair("vit")
    calls = []
    ours.blocks[0].attn.qkv.register_forward_hook(lambda *a: calls.append(torch.is_grad_enabled()))
    ours.set_grad_checkpointing(True)
    ours.train()(_x()).sum().backward()
    assert len(calls) == 2


@pytest.mark.parametrize("kw", [dict(img_size=48), dict(img_size=(32, 48)), dict(patch_size=4),
                                dict(img_size=40, patch_size=10)])
@pytest.mark.parametrize("case", ["vit", "siglip"])
def test_vit_set_input_size_matches_timm(kw, case):
    ours, theirs = _pair(case)
    ours.set_input_size(**kw)
    theirs.set_input_size(**kw)
    x = _x(kw.get("img_size"))
    with torch.no_grad():
        assert_close(ours(x), theirs(x), atol=1e-4, rtol=0)
    assert ours.pos_embed.shape == theirs.pos_embed.shape


@pytest.mark.parametrize("kw", [dict(img_size=96), dict(img_size=128), dict(img_size=96, window_size=6),
                                dict(img_size=128, window_ratio=8), dict(img_size=(64, 96)), dict(patch_size=2)])
@pytest.mark.parametrize("case", ["swin", "swinv2"])
def test_swin_set_input_size_matches_timm(kw, case):
    """Windows scale with the grid; V1's tables are resized, V2's bias MLP is read at the new window's offsets."""
    ours, theirs = _pair(case)
    ours.set_input_size(**kw)
    theirs.set_input_size(**kw)
    x = _x(kw.get("img_size"), case=case)
    with torch.no_grad():
        assert_close(ours(x), theirs(x), atol=1e-4, rtol=0)
    for (k, v), (k2, v2) in zip(sorted(ours.state_dict().items()), sorted(
            (k, v) for k, v in theirs.state_dict().items() if "relative_position_index" not in k), strict=True):
        assert k == k2 and v.shape == v2.shape, k


def test_set_input_size_then_reload_of_the_same_size():
    """set_input_size then save gives a checkpoint that a model created at that size loads strictly."""
    ours, _ = _pair("swin")
    ours.set_input_size(img_size=96)
    again = vitkit.create_model(CASES["swin"][0], **{**SWIN_KW, "img_size": 96, "window_size": ours.cfg.window_size})
    again.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert_close(again.eval()(_x(96, case="swin")), ours(_x(96, case="swin")))


@pytest.mark.parametrize("case", ["vit", "vit_reg_avg"])
def test_dynamic_img_size_matches_timm(case):
    """timm's dynamic_img_size: any multiple of the patch, positions resampled (bicubic, antialiased) per input."""
    ours, theirs = _pair(case, dynamic_img_size=True)
    for size in [(32, 32), (48, 24), (16, 64)]:
        x = _x(size, case=case)
        assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="multiples of the patch size 8"):
        ours(_x((36, 32), case=case))
