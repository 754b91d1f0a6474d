"""Checkpoint files of the backbones people fine-tune (CLIP, SigLIP, DINOv2, DINOv3, Swin V2) in the layouts that
transformers, OpenCLIP and the official DINO repositories write: each loads into vitkit with the peer's outputs.

The peers are built with random weights and save in their own format; the official DINO layouts, which no
installable package writes, are made from a timm model by the inverse of timm's conversion, and the test first
checks that timm's own ``checkpoint_filter_fn`` turns them back into that model's weights."""

import re

import pytest
import timm
import torch
from safetensors.torch import save_file
from torch.testing import assert_close

import vitkit

from .commands import error_line_of
from .test_checkpoints import _randomize  # random values everywhere, as there


def _images(size: int, n: int = 2) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(1))


def _close(ours, ref, atol=1e-4):
    assert_close(ours, ref, atol=atol * max(1.0, ref.abs().max().item()), rtol=0)


TOWER = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=160, image_size=32,
             patch_size=8)


# --- transformers ----------------------------------------------------------------------------------

@pytest.mark.parametrize("whole", [True, False], ids=["CLIPModel", "CLIPVisionModel"])
def test_transformers_clip(whole, tmp_path):
    """A whole CLIP (the text tower is left out, the projection is the classifier) or the image tower alone."""
    import transformers as T

    text = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    theirs = T.CLIPModel(T.CLIPConfig(vision_config=TOWER, text_config=text, projection_dim=24)) if whole else \
        T.CLIPVisionModel(T.CLIPVisionConfig(**TOWER))
    _randomize(theirs).save_pretrained(tmp_path)
    ours = vitkit.create_model(checkpoint=tmp_path).eval()
    assert ours.load_report.format == "transformers-clip" and ours.load_report.ok, ours.load_report
    assert ours.cfg.act_layer == "quick_gelu" and ours.cfg.pre_norm
    x = _images(32)
    with torch.no_grad():
        if whole:
            ref = theirs.get_image_features(pixel_values=x)
            ref = getattr(ref, "pooler_output", ref)
            assert ours.num_classes == 24
            _close(ours(x), ref)
        else:
            assert ours.num_classes == 0
            _close(ours(x), theirs(pixel_values=x).pooler_output)
    if whole:
        _predict_refuses_the_embedding(tmp_path)


def _predict_refuses_the_embedding(folder):
    """``vitkit predict`` on a CLIP file: its outputs are the image embedding, not classes; the error says how
    to fine-tune it, with the command's own arguments."""
    from PIL import Image


    Image.new("RGB", (40, 40), (200, 120, 40)).save(folder / "img.png")
    assert re.search(r"\(transformers-clip\) is CLIP's image tower: its 24 outputs are its image "
                     r"embedding .* --model.pretrained false --model.checkpoint ",
                     error_line_of(["predict", str(folder / "img.png"), "--checkpoint", str(folder)]))


@pytest.mark.parametrize("whole", [True, False], ids=["SiglipModel", "SiglipVisionModel"])
def test_transformers_siglip_with_its_attention_pool(whole, tmp_path):
    import transformers as T

    text = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    theirs = T.SiglipModel(T.SiglipConfig(vision_config=TOWER, text_config=text)) if whole else \
        T.SiglipVisionModel(T.SiglipVisionConfig(**TOWER))
    _randomize(theirs).save_pretrained(tmp_path)
    ours = vitkit.create_model(checkpoint=tmp_path).eval()
    assert ours.load_report.format == "transformers-siglip" and ours.load_report.ok, ours.load_report
    assert ours.cfg.global_pool == "map" and ours.cfg.act_layer == "gelu_tanh"
    x = _images(32)
    with torch.no_grad():
        ref = (theirs.vision_model if whole else theirs)(pixel_values=x)
        _close(ours.forward_features(x), ref.last_hidden_state)
        _close(ours(x), ref.pooler_output)


@pytest.mark.parametrize("gated,registers", [(False, 4), (True, 0)])
def test_transformers_dinov3(gated, registers, tmp_path):
    import transformers as T

    cfg = T.DINOv3ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                            patch_size=8, image_size=32, num_register_tokens=registers, use_gated_mlp=gated,
                            layerscale_value=0.5, hidden_act="silu" if gated else "gelu")
    theirs = _randomize(T.DINOv3ViTModel(cfg))
    theirs.save_pretrained(tmp_path)
    ours = vitkit.create_model(checkpoint=tmp_path).eval()
    assert ours.load_report.format == "transformers-dinov3" and ours.load_report.ok, ours.load_report
    assert (ours.cfg.mlp_layer, ours.cfg.reg_tokens, ours.cfg.qkv_bias) == ("swiglu" if gated else "mlp", registers,
                                                                             "qv")
    x = _images(48)  # not the config's size: DINOv3's RoPE follows the input's grid in both
    with torch.no_grad():
        _close(ours.forward_features(x), theirs(pixel_values=x).last_hidden_state)


@pytest.mark.parametrize("kind,swiglu", [("Dinov2Model", False), ("Dinov2WithRegistersModel", False),
                                         ("Dinov2Model", True)])
def test_transformers_dinov2(kind, swiglu, tmp_path):
    """DINOv2, with registers, and with DINOv2-g's packed SwiGLU (its width rounded to 8 as transformers')."""
    import transformers as T

    config = (T.Dinov2WithRegistersConfig if "Registers" in kind else T.Dinov2Config)(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=2, patch_size=8, image_size=32,
        use_swiglu_ffn=swiglu)
    theirs = _randomize(getattr(T, kind)(config))
    theirs.save_pretrained(tmp_path)
    ours = vitkit.create_model(checkpoint=tmp_path).eval()
    assert ours.load_report.format == "transformers-vit" and ours.load_report.ok, ours.load_report
    assert ours.cfg.mlp_layer == ("swiglu" if swiglu else "mlp")
    x = _images(32)
    with torch.no_grad():
        _close(ours.forward_features(x), theirs(pixel_values=x).last_hidden_state)


def test_transformers_swinv2(tmp_path):
    import transformers as T

    cfg = T.Swinv2Config(embed_dim=32, depths=[2, 2], num_heads=[2, 4], image_size=64, patch_size=4, window_size=8,
                         pretrained_window_sizes=[4, 0], num_labels=5)
    theirs = _randomize(T.Swinv2ForImageClassification(cfg))
    theirs.save_pretrained(tmp_path)
    ours = vitkit.create_model(checkpoint=tmp_path).eval()
    assert ours.load_report.format == "transformers-swinv2" and ours.load_report.ok, ours.load_report
    assert ours.cfg.version == 2 and ours.cfg.pretrained_window_sizes == (4, 8)
    x = _images(64)
    with torch.no_grad():
        _close(ours(x), theirs(pixel_values=x).logits)


# --- OpenCLIP --------------------------------------------------------------------------------------

def _open_clip(vision_cfg: dict):
    import open_clip

    text = open_clip.CLIPTextCfg(context_length=8, vocab_size=64, width=32, heads=2, layers=1)
    return _randomize(open_clip.CLIP(embed_dim=24, vision_cfg=open_clip.CLIPVisionCfg(**vision_cfg),
                                     text_cfg=text, quick_gelu=True))


def test_openclip_and_openai_clip_layout(tmp_path):
    """OpenCLIP's own ViT (the layout of OpenAI's CLIP weights): ``visual.conv1``, ``visual.proj``, ..."""
    theirs = _open_clip(dict(layers=2, width=64, head_width=16, patch_size=8, image_size=32))
    file = tmp_path / "open_clip_pytorch_model.bin"
    torch.save(theirs.state_dict(), file)
    ours = vitkit.create_model("vit_base_patch16_clip_quickgelu_224", checkpoint=file, img_size=32, patch_size=8,
                               embed_dim=64, depth=2, num_heads=4).eval()
    assert ours.load_report.format == "openai-clip" and ours.load_report.ok, ours.load_report
    x = _images(32)
    with torch.no_grad():
        _close(ours(x), theirs.encode_image(x))


def test_openclip_timm_tower(tmp_path):
    """OpenCLIP's towers built on timm (SigLIP, ...): ``visual.trunk.*`` and the projection ``visual.head.proj``."""
    theirs = _open_clip(dict(timm_model_name="vit_tiny_patch16_224", timm_pool="token", timm_proj="linear",
                             image_size=224))
    save_file(theirs.state_dict(), tmp_path / "model.safetensors")
    ours = vitkit.create_model("vit_tiny_patch16_224", checkpoint=tmp_path / "model.safetensors").eval()
    assert ours.load_report.format == "openclip-timm" and ours.load_report.ok, ours.load_report
    x = _images(224, n=1)
    with torch.no_grad():
        _close(ours(x), theirs.encode_image(x))


# --- the official DINOv2 / DINOv3 layouts ----------------------------------------------------------

def _official_dinov3(sd: dict, swiglu: bool) -> dict:
    """timm's Eva state dict in facebookresearch/dinov3's names (the inverse of timm's checkpoint_filter_fn)."""
    out = {"mask_token": torch.zeros(1, sd["cls_token"].shape[-1]), "rope_embed.periods": torch.ones(8)}
    for k, v in sd.items():
        k = k.replace("reg_token", "storage_tokens").replace("gamma_1", "ls1.gamma").replace("gamma_2", "ls2.gamma")
        if swiglu:
            k = k.replace("mlp.fc1_g", "mlp.w1").replace("mlp.fc1_x", "mlp.w2").replace("mlp.fc2", "mlp.w3")
        if k.endswith("attn.q_bias"):
            out[k.replace("q_bias", "qkv.bias")] = torch.cat([v, torch.zeros_like(v), sd[k[:-6] + "v_bias"]])
            out[k.replace("q_bias", "qkv.bias_mask")] = torch.cat([torch.ones_like(v), torch.zeros_like(v),
                                                                   torch.ones_like(v)])
        elif not k.endswith("attn.v_bias"):
            out[k] = v
    return out


@pytest.mark.parametrize("name,peer", [("vit_small_patch16_dinov3_qkvb", "vit_small_patch16_dinov3_qkvb"),
                                       ("vit_small_plus_patch16_dinov3", "vit_small_plus_patch16_dinov3"),
                                       ("vit_small_patch16_dinov3", "vit_small_patch16_dinov3_qkvb")])
def test_official_dinov3(name, peer, tmp_path):
    """Meta's DINOv3 files: storage tokens, ``qkv.bias`` with its key third masked (all zeros in the distilled
    S/B/L, which vitkit's presets without biases drop), SwiGLU as w1/w2/w3, RoPE periods and the mask token."""
    from timm.models.eva import checkpoint_filter_fn

    kw = dict(depth=2, embed_dim=64, num_heads=2, img_size=32, num_classes=0)
    theirs = _randomize(timm.create_model(peer, **kw))
    zero_bias = name != peer  # vitkit's preset has no biases; the file has them, all zeros
    if zero_bias:
        for n, p in theirs.named_parameters():
            if n.endswith(("q_bias", "v_bias")):
                p.data.zero_()
    official = _official_dinov3(theirs.state_dict(), swiglu="plus" in name)
    assert_close(checkpoint_filter_fn(official, theirs), theirs.state_dict(), atol=0, rtol=0)  # the fixture is
    torch.save({"model": official}, tmp_path / "dinov3.pth")  # Meta's layout, by timm's own reading of it
    ours = vitkit.create_model(name, checkpoint=tmp_path / "dinov3.pth", **kw).eval()
    assert ours.load_report.format == "official-dinov3" and ours.load_report.ok, ours.load_report
    assert any("dropped, all zeros" in n for n in ours.load_report.adapted) == zero_bias
    x = _images(32)
    with torch.no_grad():
        _close(ours.forward_features(x), theirs.forward_features(x))


@pytest.mark.parametrize("name", ["vit_small_patch14_dinov2", "vit_small_patch14_reg4_dinov2"])
def test_official_dinov2(name, tmp_path):
    """facebookresearch/dinov2's files: the mask token, and with registers a position for the class token."""
    from timm.models.vision_transformer import checkpoint_filter_fn

    kw = dict(depth=2, embed_dim=64, num_heads=2, img_size=28)
    theirs = _randomize(timm.create_model(name, **kw))
    official = {"mask_token": torch.zeros(1, 64), **theirs.state_dict()}
    if "reg" in name:
        cls_pos = torch.randn(1, 1, 64)
        official["register_tokens"] = official.pop("reg_token")
        official["cls_token"] = official["cls_token"] - cls_pos
        official["pos_embed"] = torch.cat([cls_pos, official["pos_embed"]], dim=1)
    assert_close(checkpoint_filter_fn(dict(official), theirs), theirs.state_dict(), atol=1e-6, rtol=0)
    torch.save(official, tmp_path / "dinov2.pth")
    ours = vitkit.create_model(name, checkpoint=tmp_path / "dinov2.pth", **kw).eval()
    assert ours.load_report.format == "official-dinov2" and ours.load_report.ok, ours.load_report
    x = _images(28)
    with torch.no_grad():
        _close(ours.forward_features(x), theirs.forward_features(x))


def test_a_transformers_config_vitkit_cannot_build_is_refused_by_name(tmp_path):
    """A model_type outside the families, or a DINOv3 whose gated MLP is not SwiGLU, is named in the error, before
    any weight is read."""
    import json

    from vitkit.checkpoints import CheckpointError

    for config, message in [({"model_type": "beit"}, r"model_type='beit'; vitkit reads vit, vit_mae, deit, dinov2"),
                            ({"model_type": "dinov3_vit", "use_gated_mlp": True, "hidden_act": "gelu"},
                             r"gated MLP and hidden_act='gelu'; vitkit's gated MLP is SwiGLU \(silu\)")]:
        folder = tmp_path / config["model_type"]
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        save_file({"embeddings.patch_embeddings.weight": torch.zeros(8, 3, 4, 4)}, folder / "model.safetensors")
        with pytest.raises(CheckpointError, match=message):
            vitkit.create_model(checkpoint=folder)


def test_a_torchscript_archive_is_refused_with_how_to_get_its_weights(tmp_path):
    """OpenAI's CLIP ``.pt`` files are TorchScript archives: reading one runs its code, so vitkit refuses it and
    says how to take its state dict; ``torch.save`` files (zips too) are not mistaken for one."""
    from vitkit.checkpoints import UnsafeCheckpointError

    theirs = _open_clip(dict(layers=1, width=32, head_width=16, patch_size=8, image_size=16))
    torch.jit.script(theirs.visual).save(tmp_path / "ViT-tiny.pt")
    with pytest.raises(UnsafeCheckpointError, match=r"TorchScript archive .*torch\.jit\.load\(path\)\.state_dict\(\)"):
        vitkit.create_model("vit_base_patch16_clip_224", checkpoint=tmp_path / "ViT-tiny.pt")
    torch.save({f"visual.{k}": v for k, v in theirs.visual.state_dict().items()}, tmp_path / "weights.pth")
    ours = vitkit.create_model("vit_base_patch16_clip_quickgelu_224", checkpoint=tmp_path / "weights.pth",
                               img_size=16, patch_size=8, embed_dim=32, depth=1, num_heads=2)
    assert ours.load_report.format == "openai-clip" and ours.load_report.ok


def test_official_swinv2(tmp_path):
    """microsoft/Swin-Transformer's Swin V2 files: patch merging at the end of a stage, ``head.*``, and the index
    and coordinate buffers persisted (vitkit rebuilds them)."""
    import re

    from timm.models.swin_transformer_v2 import checkpoint_filter_fn

    kw = dict(img_size=64, embed_dim=32, depths=(2, 2), num_heads=(2, 4), window_size=8, num_classes=5)
    theirs = _randomize(timm.create_model("swinv2_tiny_window8_256", **kw))
    official = {re.sub(r"^layers\.(\d+)\.downsample", lambda m: f"layers.{int(m[1]) - 1}.downsample", k)
                .replace("head.fc.", "head."): v for k, v in theirs.state_dict().items()}
    official["layers.0.blocks.0.attn.relative_coords_table"] = torch.zeros(1, 15, 15, 2)
    assert_close(checkpoint_filter_fn({"model": dict(official)}, theirs), theirs.state_dict(), atol=0, rtol=0)
    torch.save({"model": official}, tmp_path / "swinv2_official.pth")
    ours = vitkit.create_model("swinv2_tiny_window8_256", checkpoint=tmp_path / "swinv2_official.pth", **kw).eval()
    assert ours.load_report.format == "official-swin" and ours.load_report.ok, ours.load_report
    x = _images(64)
    with torch.no_grad():
        _close(ours(x), theirs(x))


@pytest.mark.parametrize("name", ["eva02_tiny_patch14_224", "eva02_base_patch14_224", "eva02_base_patch16_clip_224"])
def test_official_eva02(name, tmp_path):
    """baaivision/EVA's EVA-02 files: ``q_bias``/``v_bias`` beside separate projections, SwiGLU as w1/w2/w3 (w12
    packed in Ti/S), ``mlp.ffn_ln``, ``attn.inner_attn_ln`` (EVA-CLIP), persisted RoPE tables."""
    from timm.models.eva import checkpoint_filter_fn

    kw = dict(depth=2, embed_dim=64, num_heads=2, img_size=28, num_classes=5)
    theirs = _randomize(timm.create_model(name, **kw))
    swaps = [("q_proj.bias", "q_bias"), ("v_proj.bias", "v_bias"), ("mlp.fc1_g", "mlp.w1"), ("mlp.fc1_x", "mlp.w2"),
             ("mlp.fc1.", "mlp.w12."), ("mlp.fc2", "mlp.w3"), ("mlp.norm", "mlp.ffn_ln"),
             ("attn.norm", "attn.inner_attn_ln")]
    official = {"rope.freqs_cos": torch.ones(4, 8), "rope.freqs_sin": torch.zeros(4, 8)}
    for k, v in theirs.state_dict().items():
        for a, b in swaps:
            k = k.replace(a, b)
        official[k] = v
    assert_close(checkpoint_filter_fn(dict(official), theirs), theirs.state_dict(), atol=0, rtol=0)
    torch.save({"module": official}, tmp_path / "eva02.pt")
    ours = vitkit.create_model(name, checkpoint=tmp_path / "eva02.pt", **kw).eval()
    assert ours.load_report.format == "timm-eva" and ours.load_report.ok, ours.load_report
    x = _images(28)
    with torch.no_grad():
        _close(ours(x), theirs(x))
