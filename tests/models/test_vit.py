"""ViT/DeiT: timm's weights load strictly and give timm's logits, on every preset and backend."""

import pytest
import timm
import torch
from torch.testing import assert_close

import vitkit
from tests import forkserver
from tests.backends import compiled_training_step_matches_eager, needs_flex
from tests.inits import weightless
from vitkit.checkpoints.formats import to_vitkit
from vitkit.layers import resample_abs_pos_embed, sincos_2d
from vitkit.models import VIT_PRESETS

SMALL = ["vit_tiny_patch16_224", "vit_small_patch16_224", "deit_tiny_patch16_224", "deit_small_patch16_224",
         "deit_tiny_distilled_patch16_224", "vit_small_patch32_224"]
LARGE = ["vit_base_patch16_224", "vit_base_patch32_224", "vit_base_patch16_384", "deit_base_patch16_224",
         "vit_large_patch16_224", "vit_small_patch16_384", "deit3_small_patch16_224", "vit_medium_patch16_gap_256",
         "vit_betwixt_patch16_reg4_gap_256"]


def _pair(name: str, **kw):
    theirs = timm.create_model(name, pretrained=False, **kw).eval()
    ours = weightless(vitkit.create_model, name, **kw).eval()  # every tensor it saves is timm's next
    ours.load_state_dict(to_vitkit(theirs.state_dict())[0], strict=True)  # timm's Eva names two things otherwise
    return ours, theirs


def _check_logits(ours, theirs, backends=("sdpa", "math"), batch=2):
    size = ours.cfg.img_size
    x = torch.randn(batch, 3, size, size)
    with torch.no_grad():
        ref = theirs(x)
        for backend in backends:
            ours.set_attn_backend(backend)
            out = ours(x)
            assert out.shape == ref.shape
            assert (out - ref).abs().max().item() < 1e-4, backend


def test_presets_cover_the_required_names():
    required = {"vit_tiny_patch16_224", "vit_small_patch16_224", "vit_base_patch16_224", "vit_large_patch16_224",
                "vit_base_patch32_224", "vit_small_patch16_384", "vit_base_patch16_384", "deit_tiny_patch16_224",
                "deit_small_patch16_224", "deit_base_patch16_224"}
    assert required <= set(vitkit.list_models())
    assert set(vitkit.list_models("deit_*")) >= {"deit_tiny_patch16_224", "deit_base_patch16_384"}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(VIT_PRESETS))
def test_every_preset_matches_timm_at_depth_one(name):
    """Every width, head count, token layout and pooling of the table, on one block to stay fast."""
    ours, theirs = _pair(name, depth=1)
    size = theirs.patch_embed.img_size[0] if hasattr(theirs, "patch_embed") else theirs.pretrained_cfg["input_size"][-1]
    assert ours.cfg.img_size == size  # NaFlexViT's: its pretrained size (its positions keep their own grid)
    _check_logits(ours, theirs, batch=1)


@pytest.mark.parametrize("name", SMALL)
def test_small_presets_match_timm(name):
    _check_logits(*_pair(name))


@needs_flex
def test_flex_backend_matches_timm():
    ours, theirs = _pair("vit_tiny_patch16_224", depth=4)
    _check_logits(ours, theirs, backends=("flex",))


@pytest.mark.slow
@pytest.mark.parametrize("name", LARGE)
def test_large_presets_match_timm(name):
    _check_logits(*_pair(name), batch=1)


def test_overrides_match_timm_with_the_same_overrides():
    kw = dict(num_classes=10, img_size=64, depth=2, global_pool="avg", class_token=False, qkv_bias=False)
    ours, theirs = _pair("vit_small_patch16_224", **kw)
    _check_logits(ours, theirs)


def test_create_model_overrides_any_field():
    m = vitkit.create_model("vit_tiny_patch16_224", num_classes=7, img_size=32, patch_size=4, depth=2,
                            drop_path_rate=0.1, attn_backend="math")
    assert m.cfg.num_classes == 7 and len(m.blocks) == 2
    assert m.blocks[1].drop_path1.p == pytest.approx(0.1) and m.blocks[0].drop_path1.p == 0.0
    assert all(b.attn.backend == "math" for b in m.blocks)
    assert m(torch.randn(3, 3, 32, 32)).shape == (3, 7)


def test_unknown_names_and_fields_are_reported():
    with pytest.raises(TypeError, match=r"unknown config field\(s\) \['window'\]"):
        vitkit.create_model("vit_tiny_patch16_224", window=7)
    with pytest.raises(ValueError, match="unknown model 'vit_tinyy_patch16_224'"):
        vitkit.create_model("vit_tinyy_patch16_224")
    with pytest.raises(ValueError, match="attn_backend must be one of"):
        vitkit.create_model("vit_tiny_patch16_224", attn_backend="cuda")
    with pytest.raises(ValueError, match="smaller than patch_size"):
        vitkit.create_model("vit_tiny_patch16_224", img_size=8)


def test_input_errors_name_expected_and_actual_shape():
    m = vitkit.create_model("vit_tiny_patch16_224", depth=1, img_size=32, patch_size=8)
    with pytest.raises(ValueError, match=r"expects 3 input channels \(B, 3, 32, 32\), got 1 channels"):
        m(torch.randn(2, 1, 32, 32))
    with pytest.raises(ValueError, match=r"expects images of shape \(B, 3, 32, 32\), got \(2, 3, 48, 48\)"):
        m(torch.randn(2, 3, 48, 48))
    with pytest.raises(ValueError, match=r"got a 3-D tensor of shape \(3, 32, 32\)"):
        m(torch.randn(3, 32, 32))
    with pytest.raises(TypeError, match="floating-point images"):
        m(torch.zeros(2, 3, 32, 32, dtype=torch.uint8))


def test_sincos_positions_are_fixed_buffers():
    m = vitkit.create_model("vit_tiny_patch16_224", depth=1, pos_embed="sincos")
    assert "pos_embed" not in m.state_dict()
    assert not any(n == "pos_embed" for n, _ in m.named_parameters())
    pe = sincos_2d((14, 14), 192)
    assert_close(m.pos_embed[0, 1:], pe)
    # distinct positions get distinct codes, neighbours are more alike than far-apart patches
    sim = torch.nn.functional.normalize(pe, dim=-1) @ torch.nn.functional.normalize(pe, dim=-1).T
    assert sim[0, 1] > sim[0, 13] > sim[0, 14 * 13 + 13]
    assert m(torch.randn(1, 3, 224, 224)).shape == (1, 1000)
    # a model built on the meta device and given storage computes them again when its weights are loaded
    empty = weightless(vitkit.create_model, "vit_tiny_patch16_224", depth=1, pos_embed="sincos")
    empty.load_state_dict(m.state_dict())
    assert_close(empty.pos_embed, m.pos_embed, rtol=0, atol=0)


@pytest.mark.parametrize("prefix,old,new", [(1, (14, 14), (24, 24)), (0, (8, 8), (6, 10)),
                                            (5, (16, 16), (7, 7))])
def test_resample_abs_pos_embed_matches_timm(prefix, old, new):
    from timm.layers import resample_abs_pos_embed as timm_resample

    pe = torch.randn(1, prefix + old[0] * old[1], 48)
    ours = resample_abs_pos_embed(pe, new, old, num_prefix_tokens=prefix)
    theirs = timm_resample(pe, list(new), list(old), num_prefix_tokens=prefix)
    assert ours.shape == (1, prefix + new[0] * new[1], 48)
    assert_close(ours, theirs)
    assert_close(ours[:, :prefix], pe[:, :prefix])


@pytest.mark.slow
def test_compile_fullgraph_tiny_vit():
    """The forward is captured whole (fullgraph: a graph break is an error) and traced by AOTAutograd; inductor
    builds the code of the forward and backward in the training step (the backend's own build, checked there)."""
    m = vitkit.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=5).eval()
    x = torch.randn(2, 3, 32, 32)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        assert_close(compiled(x), m(x), atol=1e-5, rtol=1e-5)
    m = vitkit.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=5,
                            drop_path_rate=0.2)
    compiled_training_step_matches_eager(m, x)


@pytest.mark.slow
def test_model_code_does_not_import_lightning():
    code = ("import sys, vitkit, vitkit.models, vitkit.layers; m = vitkit.create_model('vit_tiny_patch16_224');"
            "bad = [k for k in sys.modules if k.split('.')[0] in ('lightning', 'pytorch_lightning')];"
            "assert not bad, bad")
    out = forkserver.run(["-c", code], timeout=240, preload="torch")  # forked from an interpreter with torch alone
    assert out.returncode == 0, out.stderr[-2000:]


def _distilled_pair(**kw):
    return _pair("deit_tiny_distilled_patch16_224", depth=2, **kw)


def test_deit_distilled_averages_its_two_heads_and_trains_them_apart_as_timm_does():
    """DeiT's distillation token and second head: the mean of both heads at inference, pre_logits the mean of
    the two tokens, and with distilled training on, both heads' logits in training, each equal to timm's."""
    ours, theirs = _distilled_pair()
    assert ours.num_prefix_tokens == theirs.num_prefix_tokens == 2
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_close(ours(x), theirs(x), atol=1e-5, rtol=0)
        f = ours.forward_features(x)
        assert_close(ours.forward_head(f, pre_logits=True), (f[:, 0] + f[:, 1]) / 2, atol=0, rtol=0)
    ours.set_distilled_training(True)
    theirs.set_distilled_training(True)
    ours.train(), theirs.train()
    with torch.no_grad():
        for a, b in zip(ours(x), theirs(x), strict=True):
            assert_close(a, b, atol=1e-5, rtol=0)
    ours.reset_classifier(7)
    head, head_dist = ours.get_classifier()
    assert head.out_features == head_dist.out_features == 7 and ours.eval()(x).shape == (2, 7)


def test_deit_distilled_fine_tunes_with_both_heads_new_and_needs_the_class_token(tmp_path):
    _, theirs = _distilled_pair()
    torch.save(theirs.state_dict(), tmp_path / "deit.pth")
    ours = vitkit.create_model("deit_tiny_distilled_patch16_224", depth=2, num_classes=10,
                               checkpoint=tmp_path / "deit.pth")
    report = str(ours.load_report)
    assert "head.weight: new classifier (10, 192)" in report and "head_dist.weight: new classifier (10, 192)" in report
    with pytest.raises(ValueError, match="distilled=True .* needs class_token=True and global_pool='token'"):
        vitkit.create_model("deit_tiny_distilled_patch16_224", global_pool="avg")


@pytest.mark.parametrize("name", ["vit_tiny_patch16_224", "swin_tiny_patch4_window7_224"])
def test_a_config_changes_through_configure_alone_and_in_its_own_model(name):
    """ViT and Swin take a config change the same way: ``model.configure(field=...)`` changes what forward reads
    from the next call; setting a field of a built model's config in place is refused (it would leave the model
    reading the old value), and a deep or pickled copy follows its own config, not the original's."""
    import copy
    import pickle

    small = dict(img_size=32, patch_size=8, depth=1) if name.startswith("vit") else \
        dict(img_size=32, patch_size=4, depths=(1, 1), num_heads=(1, 2), embed_dim=16, window_size=4)
    m = vitkit.create_model(name, num_classes=3, **small).eval()
    x = torch.randn(1, 3, 32, 32)
    with pytest.raises(AttributeError, match=r"read-only.*model.configure\(global_pool=...\)"):
        m.cfg.global_pool = "max"
    twin = copy.deepcopy(m)
    back = pickle.loads(pickle.dumps(m))
    before = m.forward_features(x)
    m.configure(global_pool="max")
    pooled = before[:, m.num_prefix_tokens:].amax(dim=1) if name.startswith("vit") else before.amax(dim=(1, 2))
    torch.testing.assert_close(m.forward_head(before, pre_logits=True), pooled)
    for copied in (twin, back):
        assert copied.cfg.global_pool != "max"
        torch.testing.assert_close(copied(x), twin(x))
        assert not torch.allclose(copied(x), m(x))
    with pytest.raises(ValueError, match=r"no field\(s\) \['nope'\]"):
        m.configure(nope=1)
