"""timm's model contract on vitkit's models: the attributes and configs timm's tools read, TorchScript, fx tracing
through torchvision's and timm's feature extractors, and timm's three backbone wrappers. Every preset is checked for its
configs; one tiny config per kind of ViT and Swin is compared with timm's model on the same weights."""

import pytest
import timm
import torch
from timm.data import create_transform, resolve_data_config, resolve_model_data_config
from timm.models import get_pretrained_cfg
from timm.models._features import FeatureGetterNet  # timm exports it from no public module
from torch.testing import assert_close
from torchvision.models.feature_extraction import create_feature_extractor, get_graph_node_names

import vitkit
from vitkit.checkpoints.formats import to_vitkit

IMAGE_PRESETS = [n for n in vitkit.list_models() if vitkit.family(n) in ("vit", "swin")]
TINY = {"vit": dict(depth=1, embed_dim=16, num_heads=2), "swin": dict(depths=(1, 1, 1, 1), embed_dim=8,
                                                                      num_heads=(1, 1, 1, 1))}
# the kinds of ViT and Swin: class token, LayerScale with positions on patches only, registers with average
# pooling, CLIP's pre-norm with QuickGELU, SigLIP's attention pool, DINOv3's RoPE, Swin, Swin V2; small enough for fx
# and backward at full width of the test image
PAIRS = {"vit": ("vit_tiny_patch16_224", dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2)),
         "deit3": ("deit3_small_patch16_224", dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2)),
         "reg_gap": ("vit_base_patch16_reg4_gap_256", dict(img_size=32, patch_size=8, embed_dim=32, depth=4,
                                                           num_heads=2)),
         "clip": ("vit_base_patch32_clip_quickgelu_224", dict(img_size=32, patch_size=8, embed_dim=32, depth=2,
                                                             num_heads=2)),
         "siglip": ("vit_base_patch16_siglip_224", dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2)),
         "dinov3": ("vit_small_patch16_dinov3_qkvb", dict(img_size=32, patch_size=8, embed_dim=32, depth=2,
                                                          num_heads=2)),
         "rope_mixed": ("vit_small_patch16_rope_mixed_224", dict(img_size=32, patch_size=8, embed_dim=32, depth=2,
                                                                 num_heads=2)),
         "eva02_clip": ("eva02_base_patch16_clip_224", dict(img_size=32, patch_size=8, embed_dim=32, depth=2,
                                                            num_heads=2)),
         "swin": ("swin_tiny_patch4_window7_224", dict(img_size=64, embed_dim=16, depths=(1, 1, 2, 1),
                                                       num_heads=(1, 2, 2, 4), window_size=4)),
         "swinv2": ("swinv2_tiny_window8_256", dict(img_size=64, embed_dim=16, depths=(1, 1, 2, 1),
                                                    num_heads=(1, 2, 2, 4), window_size=4))}


def _pair(case: str, **extra):
    """(vitkit model, timm model) of one config, timm's weights randomised and copied into vitkit's."""
    name, kw = PAIRS[case]
    theirs = timm.create_model(name, **kw, **extra)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    ours = vitkit.create_model(name, **kw, **extra)
    ours.load_state_dict(to_vitkit(theirs.state_dict())[0])  # Swin's index buffers dropped, Eva's names mapped
    return ours.eval(), theirs.eval()


def _x(model, batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, *model.pretrained_cfg["input_size"], generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", IMAGE_PRESETS)
def test_every_preset_carries_timms_pretrained_cfg_and_gives_timms_preprocessing(name):
    """The bare preset's pretrained_cfg is timm's of the same name, key for key (fixed_input_size, pool_size,
    the default tag's source included); default_cfg is the same dict; timm's data helpers then give the
    preprocessing they give for timm's model."""
    model = vitkit.create_model(name, **TINY[vitkit.family(name)])
    timm_cfg = get_pretrained_cfg(name).to_dict()
    if timm_cfg["first_conv"] == "embeds.proj":  # NaFlexViT's linear patch projection is vitkit's patch conv
        timm_cfg["first_conv"] = "patch_embed.proj"
    assert model.pretrained_cfg == timm_cfg
    assert isinstance(model.get_submodule(model.pretrained_cfg["first_conv"]), torch.nn.Conv2d)
    assert model.default_cfg is model.pretrained_cfg
    assert model.head_hidden_size == model.num_features > 0
    data = resolve_model_data_config(model)
    assert data == resolve_data_config(pretrained_cfg=timm_cfg)
    assert repr(create_transform(**data)) == repr(create_transform(**resolve_data_config(pretrained_cfg=timm_cfg)))


@pytest.mark.slow
@pytest.mark.parametrize("name", IMAGE_PRESETS)
def test_every_preset_scripts_and_traces_to_its_eager_logits(name):
    """torch.jit.script of the model, torch.fx.symbolic_trace of it, and the traced graph scripted (timm's
    fx + TorchScript check): each gives the eager logits, bit for bit, at the preset's input size (narrow and
    one block or stage deep, so that every size and token layout of the presets is run). TorchScript runs the sdpa
    path (it has no timed choice), so eager runs it too: `auto` may time the math path faster on another CPU."""
    model = vitkit.create_model(name, **TINY[vitkit.family(name)]).eval()
    model.set_attn_backend("sdpa")
    x = _x(model, batch=1)
    with torch.no_grad():
        eager = model(x)
        assert torch.equal(torch.jit.script(model)(x), eager)
        graph = torch.fx.symbolic_trace(model)
        assert torch.equal(graph(x), eager)
        assert torch.equal(torch.jit.script(graph)(x), eager)


@pytest.mark.slow
@pytest.mark.parametrize("name", IMAGE_PRESETS)
def test_every_preset_passes_timms_backward_intermediates_and_features_checks(name):
    """What timm's model tests check of every model, on every preset (narrow, one block or stage deep): a new
    head of 42 classes, a gradient for every parameter, forward_intermediates that end in forward_features with
    one map per feature_info entry of its channels and stride, and a features_only backbone of those maps."""
    tiny = TINY[vitkit.family(name)]
    model = vitkit.create_model(name, num_classes=42, **tiny).train()
    x = _x(model)
    out = model(x)
    assert out.shape == (2, 42)
    out.mean().backward()
    assert [n for n, p in model.named_parameters() if p.grad is None] == []
    model.eval()
    with torch.no_grad():
        final, maps = model.forward_intermediates(x)
        assert torch.equal(final, model.forward_features(x))
        assert len(maps) == len(model.feature_info)
        for info, m in zip(model.feature_info, maps, strict=True):  # NCHW
            assert m.shape[:2] == (2, info["num_chs"])
            r = info["reduction"]  # ViT drops a remainder of the patch size (a conv stem); Swin pads it
            assert tuple(m.shape[2:]) == tuple(s // r if vitkit.family(name) == "vit" else -(-s // r)
                                               for s in x.shape[2:])
        backbone = vitkit.create_model(name, features_only=True, **tiny).eval()
        feats = backbone(x)
    assert [f.shape[-1 if backbone.output_fmt == "NHWC" else 1] for f in feats] == backbone.feature_info.channels()


@pytest.mark.parametrize("case", list(PAIRS))
def test_a_scripted_model_trains_and_checks_its_input(case):
    """In training mode (drop path on) the scripted model gives every parameter a gradient; an input of the
    wrong size is refused with the eager message."""
    ours, _ = _pair(case, drop_path_rate=0.1)
    scripted = torch.jit.script(ours.train())
    scripted(_x(ours)).mean().backward()
    assert all(p.grad is not None for p in scripted.parameters())
    if getattr(ours.cfg, "dynamic_img_size", False):  # any size that holds whole patches (DINOv3)
        with pytest.raises(torch.jit.Error, match=r"multiples of the patch size 8, got \(1, 3, 12, 16\)"):
            scripted(torch.randn(1, 3, 12, 16))
        return
    with pytest.raises(torch.jit.Error, match=r"expects images of shape \(B, 3, \d+, \d+\), got \(1, 3, 8, 8\)"):
        scripted(torch.randn(1, 3, 8, 8))


def test_a_tag_without_weights_builds_and_refuses_only_pretrained_true():
    model = vitkit.create_model("vit_base_patch16_reg4_gap_256.untrained", **TINY["vit"])
    assert model.pretrained_cfg["tag"] == "untrained" and model.pretrained_cfg["input_size"] == (3, 256, 256)
    with pytest.raises(ValueError, match="timm has no weights for this tag"):
        vitkit.create_model("vit_base_patch16_reg4_gap_256.untrained", pretrained=True, **TINY["vit"])


@pytest.mark.parametrize("case", list(PAIRS))
def test_the_attributes_timms_tools_read_match_timms_model(case):
    ours, theirs = _pair(case)
    for attr in ("num_features", "head_hidden_size", "num_classes", "num_prefix_tokens", "output_fmt"):
        assert getattr(ours, attr, None) == getattr(theirs, attr, None), attr
    assert ours.feature_info == theirs.feature_info
    x = _x(ours)
    with torch.no_grad():
        assert_close(ours(x), theirs(x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", list(PAIRS))
def test_fx_traced_forward_equals_eager_and_backward_reaches_every_parameter(case):
    """torch.fx.symbolic_trace and torchvision's create_feature_extractor (no leaf list given: the input check,
    the attention and Swin's window index are kept whole by torch.fx.wrap), forward exactly equal to eager;
    a traced training graph gives every parameter a gradient."""
    ours, _ = _pair(case)
    x = _x(ours)
    with torch.no_grad():
        eager = ours(x)
        assert torch.equal(torch.fx.symbolic_trace(ours)(x), eager)
        _, eval_nodes = get_graph_node_names(ours)
        extractor = create_feature_extractor(ours, return_nodes=[eval_nodes[-1]])
        assert torch.equal(next(iter(extractor(x).values())), eager)
    ours.train()
    graph = torch.fx.symbolic_trace(ours)
    graph(x).mean().backward()
    missing = [n for n, p in graph.named_parameters() if p.grad is None]
    assert not missing and len(list(graph.parameters())) == len(list(ours.parameters()))


def test_a_traced_model_still_checks_its_input():
    ours, _ = _pair("swin")
    graph = torch.fx.symbolic_trace(ours)
    with pytest.raises(ValueError, match=r"expects images of shape \(B, 3, 64, 64\), got \(1, 3, 32, 32\)"):
        graph(torch.randn(1, 3, 32, 32))
    with pytest.raises(ValueError, match="expects a batch of images"):
        torch.fx.symbolic_trace(_pair("vit")[0])(torch.randn(3, 32, 32))


@pytest.mark.parametrize("case", list(PAIRS))
@pytest.mark.parametrize("feature_cls", ["getter", "fx", "hook"])
def test_features_only_through_each_of_timms_feature_classes_equals_timms(case, feature_cls, tmp_path):
    """features_only with feature_cls getter / fx / hook, weights from one file: the maps, channels and reductions
    of timm's model of the same name built the same way (ViT blocks give token maps (B, N, C) through fx and
    hooks, as timm's do)."""
    name, kw = PAIRS[case]
    torch.save(_pair(case)[1].state_dict(), tmp_path / "weights.pth")
    features = dict(features_only=True, feature_cls=feature_cls,
                    out_indices=(1, 2) if case.startswith("swin") else (0, 1))
    ours = vitkit.create_model(name, checkpoint=tmp_path / "weights.pth", **kw, **features).eval()
    theirs = timm.create_model(name, pretrained=True, pretrained_cfg_overlay={"file": str(tmp_path / "weights.pth")},
                               **kw, **features).eval()
    assert type(ours).__name__ == ("FeatureNet" if feature_cls == "getter" else type(theirs).__name__)
    assert ours.feature_info.channels() == theirs.feature_info.channels()
    assert ours.feature_info.reduction() == theirs.feature_info.reduction()
    x = _x(ours)
    with torch.no_grad():
        a, b = ours(x), theirs(x)
    assert len(a) == len(b) == 2
    for u, v in zip(a, b, strict=True):
        assert_close(u, v, atol=1e-5, rtol=0)


def test_feature_cfg_is_timms_other_spelling_and_timms_getter_wraps_a_vitkit_model():
    ours = vitkit.create_model("vit_tiny_patch16_224", **PAIRS["vit"][1], features_only=True,
                               feature_cfg={"feature_cls": "fx", "out_indices": (1,)})
    assert type(ours).__name__ == "FeatureGraphNet" and len(ours(torch.randn(1, 3, 32, 32))) == 1
    plain, _ = _pair("deit3")
    x = _x(plain)
    with torch.no_grad():
        expected = plain.forward_intermediates(x, indices=[0, 1], intermediates_only=True)
        got = FeatureGetterNet(plain, out_indices=(0, 1))(x)
    for u, v in zip(got, expected, strict=True):
        assert_close(u, v, atol=0, rtol=0)
    with pytest.raises(ValueError, match="feature_cls must be one of"):
        vitkit.create_model("vit_tiny_patch16_224", **PAIRS["vit"][1], features_only=True, feature_cls="list")
    with pytest.raises(TypeError, match="apply with features_only=True"):
        vitkit.create_model("vit_tiny_patch16_224", **PAIRS["vit"][1], feature_cls="fx")
