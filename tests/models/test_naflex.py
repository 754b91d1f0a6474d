"""timm's NaFlexViT on vitkit: its weights load strictly, and give timm's outputs on images of any size, on timm's
own padded NaFlex batches (its Patchify and NaFlexCollator), and image by image on packed batches."""

import pytest
import timm
import torch
from safetensors.torch import load_file
from timm.data.naflex_dataset import NaFlexCollator
from timm.data.naflex_transforms import Patchify
from torch.testing import assert_close

import vitkit
from vitkit.checkpoints.formats import to_vitkit
from vitkit.models.packing import from_naflex, pack

from ..hub_cache import cache_weights, use_offline_cache

SMALL = dict(embed_dim=64, num_heads=4, depth=2)
PRESETS = ["naflexvit_base_patch16_gap", "naflexvit_base_patch16_par_gap", "naflexvit_base_patch16_map",
           "naflexvit_base_patch16_siglip", "naflexvit_so150m2_patch16_reg1_gap"]
GRIDS = [(8, 5), (3, 12), (6, 6), (1, 20), (24, 24)]  # patch grids: tall, wide, square, a strip, 384 px


def _pair(name: str):
    """timm's model with random weights (positions large, so that how they resample shows in the outputs), and
    vitkit's preset loaded from its state dict."""
    torch.manual_seed(0)
    theirs = timm.create_model(name, **SMALL).eval()
    for key, p in theirs.named_parameters():
        torch.nn.init.normal_(p, std=1.0 if "pos_embed" in key else 0.2 if p.dim() < 2 else 0.05)
    sd, fmt = to_vitkit(theirs.state_dict())
    assert fmt == "timm-naflex"
    ours = vitkit.create_model(name, **SMALL).eval()
    ours.load_state_dict(sd, strict=True)
    return ours, theirs


def _images() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(3, 16 * h, 16 * w, generator=g) for h, w in GRIDS]


@pytest.mark.parametrize("name", PRESETS)
@torch.no_grad()
def test_naflex_presets_give_timms_outputs_on_images_padded_batches_and_packed_ones(name):
    ours, theirs = _pair(name)
    images = _images()
    for img in images[:3] + images[-1:]:  # timm's plain path: an image batch of one size
        x = torch.stack([img, img.flip(-1)])
        assert_close(ours(x), theirs(x), atol=1e-5, rtol=0)
    # timm's own loader pieces: each image patchified, the batch padded to 600 tokens with patch_valid
    batch, _ = NaFlexCollator(max_seq_len=600)([(Patchify(16)(img), 0) for img in images])
    ref = theirs(batch)
    assert_close(ours.forward_packed(from_naflex(batch, 16, ours.num_prefix_tokens)), ref, atol=1e-5, rtol=0)
    packed = pack(images, 16, 640, ours.num_prefix_tokens)  # several images a sequence
    assert packed.image.shape[0] < len(images)
    assert_close(ours.forward_packed(packed), ref, atol=1e-5, rtol=0)


@torch.no_grad()
def test_each_naflex_setting_is_what_makes_timms_outputs():
    """The three settings NaFlexViT differs by; with any one of them off, the outputs are not timm's."""
    x = torch.randn(1, 3, 128, 448)
    for name, off in [("naflexvit_base_patch16_par_gap", dict(pos_keep_aspect=False)),
                      ("naflexvit_base_patch16_map", dict(map_prefix=True)),
                      ("naflexvit_base_patch16_siglip", dict(pos_interp="bicubic"))]:
        ours, theirs = _pair(name)
        other = vitkit.create_model(name, **SMALL, **off).eval()
        other.load_state_dict(ours.state_dict())
        assert (other(x) - theirs(x)).abs().max() > 1e-4, off


@torch.no_grad()
def test_a_saved_naflex_model_loads_into_timm_strictly(tmp_path):
    ours, _ = _pair("naflexvit_base_patch16_gap")
    vitkit.save_pretrained(ours, tmp_path / "out")
    theirs = timm.create_model("naflexvit_base_patch16_gap", **SMALL).eval()
    theirs.load_state_dict(load_file(tmp_path / "out" / "model.safetensors"), strict=True)
    x = torch.randn(2, 3, 208, 144)
    assert_close(theirs(x), ours(x), atol=1e-5, rtol=0)
    again = vitkit.create_model(checkpoint=str(tmp_path / "out")).eval()
    assert_close(again(x), ours(x), atol=0, rtol=0)


@torch.no_grad()
def test_naflex_tag_loads_from_the_hub_cache_at_timms_input_size(tmp_path, monkeypatch):
    """By timm's tag, offline: the model takes timm's 384-px input size and keeps its 16 x 16 positions."""
    use_offline_cache(monkeypatch, tmp_path / "hf")
    tag = "naflexvit_base_patch16_gap.e300_s576_in1k"
    _, theirs = _pair("naflexvit_base_patch16_gap")
    cache_weights(tmp_path / "hf", tag, theirs, tmp_path)
    ours = vitkit.create_model(tag, pretrained=True, **SMALL).eval()
    assert ours.cfg.img_size == 384 and ours.pos_embed.shape == (1, 256, 64) and ours.load_report.ok
    x = torch.randn(2, 3, 384, 384)
    assert_close(ours(x), theirs(x), atol=1e-5, rtol=0)


def test_bad_naflex_input_is_named():
    batch, _ = NaFlexCollator(max_seq_len=40)([(Patchify(16)(img), 0) for img in _images()[:2]])
    with pytest.raises(ValueError, match=r"lacks \['patch_valid'\]"):
        from_naflex({k: v for k, v in batch.items() if k != "patch_valid"}, 16, 4)
    with pytest.raises(ValueError, match=r"\(B, N, 14·14·C\) for the model's 14-px patches, got \(2, 40, 768\)"):
        from_naflex(batch, 14, 4)
    batch["patch_valid"][1] = False
    with pytest.raises(ValueError, match="no valid patch"):
        from_naflex(batch, 16, 4)
    with pytest.raises(ValueError, match="pos_grid=16 .* needs pos_embed='learn' and dynamic_img_size=True"):
        vitkit.create_model("naflexvit_base_patch16_gap", **SMALL, dynamic_img_size=False)
    factorized = timm.create_model("naflexvit_base_patch16_parfac_gap", **SMALL).state_dict()
    with pytest.raises(ValueError, match="factorized positions"):
        to_vitkit(factorized)
