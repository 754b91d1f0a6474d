"""Depth from one image: transformers' Depth Anything folders load into vitkit's DPT depth model on the one ViT and
give transformers' depth, relative and metric, at the preset's size and at other sizes (the positions resampled as
transformers' DINOv2 resamples them)."""

import pytest
import torch

import vitkit
from vitkit.errors import CheckpointError, MissingFileError, UsageError
from vitkit.models.depth import build_depth_model

transformers = pytest.importorskip("transformers")


def _depth_anything(path, kind: str, std: float):
    """A random Depth Anything of transformers' (DINOv2 of 4 blocks, patch 8, 40 px), every weight drawn, saved."""
    backbone = transformers.Dinov2Config(hidden_size=32, num_hidden_layers=4, num_attention_heads=2, patch_size=8,
                                         image_size=40, out_indices=[1, 2, 3, 4], reshape_hidden_states=False)
    cfg = transformers.DepthAnythingConfig(backbone_config=backbone, neck_hidden_sizes=[8, 16, 32, 32],
                                           fusion_hidden_size=16, head_hidden_size=8, reassemble_hidden_size=32,
                                           patch_size=8, depth_estimation_type=kind, max_depth=20)
    torch.manual_seed(0)
    theirs = transformers.DepthAnythingForDepthEstimation(cfg).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, std)
    theirs.save_pretrained(path)
    return theirs


@pytest.mark.parametrize("kind, std", [("relative", 0.2), ("metric", 0.1)])
def test_a_transformers_depth_anything_folder_gives_its_depth_at_any_size(tmp_path, kind, std):
    theirs = _depth_anything(tmp_path, kind, std)
    ours = vitkit.load_depth_estimator(tmp_path).eval()
    assert ours.kind == kind and ours.indices == [0, 1, 2, 3]
    for h, w in ((40, 40), (56, 72), (64, 48)):  # the preset's size, and grids of their own aspect
        x = torch.randn(2, 3, h, w, generator=torch.Generator().manual_seed(h))
        with torch.no_grad():
            expected, got = theirs(pixel_values=x).predicted_depth, ours(x)
        assert got.shape == (2, h, w)
        assert expected.std() > 0.01 and (kind == "relative" or expected.max() < 20)  # neither flat nor saturated
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_an_input_of_part_patches_is_padded_and_the_map_cut_back():
    backbone = vitkit.create_model("vit_tiny_patch16_224", num_classes=0, img_size=32, patch_size=8, embed_dim=32,
                                   depth=4, num_heads=2)
    model = build_depth_model(backbone, channels=16, hidden=8).eval()
    x = torch.randn(1, 3, 37, 45)
    with torch.no_grad():
        padded = model(torch.nn.functional.pad(x, (0, 3, 0, 3)))
        assert model(x).shape == (1, 37, 45) and (model(x) >= 0).all()
    assert padded.shape == (1, 40, 48)


def test_what_is_not_a_depth_anything_is_refused_in_one_line(tmp_path):
    with pytest.raises(MissingFileError, match="is not there: vitkit.load_depth_estimator reads a local folder"):
        vitkit.load_depth_estimator(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="expected a folder of transformers' DepthAnythingForDepthEstimation"):
        vitkit.load_depth_estimator(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "glpn"}')
    with pytest.raises(CheckpointError, match="has model_type='glpn'; vitkit reads depth estimators of model_type "
                       "'depth_anything' and 'dpt'"):
        vitkit.load_depth_estimator(tmp_path)
    backbone = vitkit.create_model("vit_tiny_patch16_224", num_classes=0, img_size=32, patch_size=8, depth=4)
    with pytest.raises(UsageError, match="save_pretrained writes a classifier or a backbone .* a depth model"):
        vitkit.save_pretrained(build_depth_model(backbone, channels=16), tmp_path / "saved")
    swin = vitkit.create_model("swin_tiny_patch4_window7_224", num_classes=0)
    with pytest.raises(UsageError, match="DPT's depth head reads a plain ViT's maps of one resolution"):
        build_depth_model(swin)


@pytest.mark.parametrize("head", ["dpt", "linear"])
def test_every_weight_a_depth_model_trains_gets_a_gradient(head):
    """DDP stops on a trainable parameter without a gradient: DPT's coarsest fusion's skip unit, which never runs,
    is not trainable, and every other weight learns."""
    backbone = vitkit.create_model("vit_tiny_patch16_224", num_classes=0, img_size=32, patch_size=8, embed_dim=32,
                                   depth=4, num_heads=2)
    model = build_depth_model(backbone, channels=16, hidden=8, head=head).train()
    model(torch.randn(2, 3, 32, 32)).square().mean().backward()
    assert [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None] == []
    if head == "dpt":
        assert not any(p.requires_grad for p in model.head.fusions[3].skip.parameters())
