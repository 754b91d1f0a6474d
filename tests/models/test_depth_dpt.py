"""DPT's depth models of other libraries: transformers' ``DPTForDepthEstimation`` folders (Intel's DPT on its own ViT,
Meta's DPT-DINOv2) and Meta's DINOv2 depth head files (DPT and the binned linear heads, the backbone from its own
file) load into vitkit's depth model on the one ViT and give the peer's depth at the preset's size and at others
(DPT's output, 16/14 of the input at 14-pixel patches or of an odd grid's size, resized to the input as Meta's
depthers resize it)."""

import numpy as np
import pytest
import torch
from torch.nn import functional as F

import vitkit
from vitkit.errors import CheckpointError, UsageError

transformers = pytest.importorskip("transformers")


def _drawn(model, std: float):
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, std)
    return model.eval()


def _at_input(depth, size):
    """transformers' depth resized to the input's size (bilinear, corners not aligned: Meta's ``resize``)."""
    return F.interpolate(depth[:, None], size=size, mode="bilinear", align_corners=False)[:, 0]


def _dpt_dinov2(std: float = 0.05):
    """A random DPT-DINOv2 of transformers' (4 blocks 64 wide, patch 14, 56 px), set as Meta's conversion sets it:
    blocks read without the final norm, fusions without biases, a projection before the head (256 wide, fixed)."""
    backbone = transformers.Dinov2Config(hidden_size=64, num_hidden_layers=4, num_attention_heads=1, patch_size=14,
                                         image_size=56, out_indices=[1, 2, 3, 4],
                                         apply_layernorm=False, reshape_hidden_states=False)
    cfg = transformers.DPTConfig(backbone_config=backbone, neck_hidden_sizes=[8, 16, 32, 64], fusion_hidden_size=256,
                                 use_bias_in_fusion_residual=False, add_projection=True)
    return _drawn(transformers.DPTForDepthEstimation(cfg), std)


def test_a_transformers_dpt_on_its_own_vit_gives_its_depth(tmp_path):
    cfg = transformers.DPTConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64,
                                 image_size=64, patch_size=16, backbone_out_indices=[0, 1, 2, 3],
                                 neck_hidden_sizes=[8, 16, 24, 32], fusion_hidden_size=16, readout_type="project")
    theirs = _drawn(transformers.DPTForDepthEstimation(cfg), 0.2)
    theirs.save_pretrained(tmp_path)
    ours = vitkit.load_depth_estimator(tmp_path).eval()
    assert ours.kind == "relative" and ours.indices == [0, 1, 2, 3] and not ours.norm
    for side in (64, 80, 96):  # the preset's, an odd grid (DPT's fusions double: 96 px out), another (transformers'
        x = torch.randn(2, 3, side, side, generator=torch.Generator().manual_seed(side))  # DPT takes squares alone)
        with torch.no_grad():
            expected, got = _at_input(theirs(pixel_values=x).predicted_depth, (side, side)), ours(x)
        assert expected.std() > 0.01
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_a_transformers_dpt_dinov2_gives_its_depth_at_any_size(tmp_path):
    theirs = _dpt_dinov2()
    theirs.save_pretrained(tmp_path)
    ours = vitkit.load_depth_estimator(tmp_path).eval()
    assert ours.kind == "metric" and ours.indices == [0, 1, 2, 3]
    for h, w in ((56, 56), (42, 70)):
        x = torch.randn(2, 3, h, w, generator=torch.Generator().manual_seed(h))
        with torch.no_grad():
            out = theirs(pixel_values=x).predicted_depth
            expected, got = _at_input(out, (h, w)), ours(x)
        assert out.shape[-2:] != (h, w) and expected.std() > 0.01  # 16/14 of the input, more at odd grids
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def _backbone(theirs, path):
    """transformers' DINOv2 saved in Meta's names and built from that file as a 4-block vitkit DINOv2 (a size
    no preset has, so named)."""
    torch.save(_meta_backbone(theirs), path)
    return vitkit.create_model("vit_small_patch14_dinov2", checkpoint=path, num_classes=0, img_size=56, depth=4,
                               embed_dim=64, num_heads=1)


def _meta_backbone(theirs) -> dict:
    """transformers' DINOv2 in the names of Meta's ``dinov2_vits14_pretrain.pth`` (q, k and v in one matrix)."""
    sd, out = theirs.backbone.state_dict(), {}
    out.update(cls_token=sd["embeddings.cls_token"], mask_token=sd["embeddings.mask_token"],
               pos_embed=sd["embeddings.position_embeddings"], **{"norm.weight": sd["layernorm.weight"],
                                                                   "norm.bias": sd["layernorm.bias"]})
    out["patch_embed.proj.weight"] = sd["embeddings.patch_embeddings.projection.weight"]
    out["patch_embed.proj.bias"] = sd["embeddings.patch_embeddings.projection.bias"]
    for i in range(4):
        layer, block = f"encoder.layer.{i}.", f"blocks.{i}."
        for ours, meta in (("norm1", "norm1"), ("norm2", "norm2"), ("mlp.fc1", "mlp.fc1"), ("mlp.fc2", "mlp.fc2"),
                           ("attention.o_proj", "attn.proj")):
            for p in ("weight", "bias"):
                out[f"{block}{meta}.{p}"] = sd[f"{layer}{ours}.{p}"]
        out[f"{block}ls1.gamma"] = sd[f"{layer}layer_scale1.lambda1"]
        out[f"{block}ls2.gamma"] = sd[f"{layer}layer_scale2.lambda1"]
        for p in ("weight", "bias"):
            out[f"{block}attn.qkv.{p}"] = torch.cat([sd[f"{layer}attention.{n}_proj.{p}"] for n in "qkv"])
    return out


def _meta_dpt_head(theirs) -> dict:
    """transformers' DPT neck and head in the names of Meta's ``dinov2_vits14_nyu_dpt_head.pth`` (mmcv's)."""
    sd, out = theirs.state_dict(), {}
    rules = [("neck.reassemble_stage.layers.{i}.projection.", "reassemble_blocks.projects.{i}.conv."),
             ("neck.reassemble_stage.readout_projects.{i}.0.", "reassemble_blocks.readout_projects.{i}.0."),
             ("neck.reassemble_stage.layers.{i}.resize.", "reassemble_blocks.resize_layers.{i}."),
             ("neck.convs.{i}.", "convs.{i}.conv."),
             ("neck.fusion_stage.layers.{i}.projection.", "fusion_blocks.{i}.project.conv."),
             *((f"neck.fusion_stage.layers.{{i}}.residual_layer{u}.convolution{c}.",
                f"fusion_blocks.{{i}}.res_conv_unit{u}.conv{c}.conv.") for u in (1, 2) for c in (1, 2)),
             ("head.projection.", "project.conv."), ("head.head.{i}.", "conv_depth.head.{i}.")]
    for k, v in sd.items():
        for theirs_name, meta in rules:
            for i in range(5):
                if k.startswith(theirs_name.format(i=i)):
                    if not k.startswith("neck.fusion_stage.layers.0.residual_layer1"):  # Meta's has none
                        out["decode_head." + meta.format(i=i) + k[len(theirs_name.format(i=i)):]] = v
                    break
    return out


def test_a_dinov2_dpt_head_file_on_its_backbone_file_gives_metas_depth(tmp_path):
    theirs = _dpt_dinov2()
    head, backbone = tmp_path / "dinov2_vits14_nyu_dpt_head.pth", tmp_path / "dinov2_vits14_pretrain.pth"
    torch.save({"meta": {}, "state_dict": _meta_dpt_head(theirs)}, head)
    ours = vitkit.load_depth_estimator(head, backbone=_backbone(theirs, backbone)).eval()
    assert ours.kind == "metric" and ours.head.max_depth == 10.0 and ours.indices == [0, 1, 2, 3]
    for h, w in ((56, 56), (42, 70)):
        x = torch.randn(2, 3, h, w, generator=torch.Generator().manual_seed(h))
        with torch.no_grad():
            expected, got = _at_input(theirs(pixel_values=x).predicted_depth, (h, w)), ours(x)
        assert 0.01 < expected.std() and expected.max() < 9  # the clamp to 10 m is not what agrees
        torch.testing.assert_close(got, expected + 1e-3, atol=1e-4, rtol=1e-4)  # Meta's: ReLU + min_depth
    with torch.no_grad():
        capped = vitkit.load_depth_estimator(head, backbone=_backbone(theirs, backbone), max_depth=0.5).eval()(x)
    assert 0.49 < capped.max() <= 0.5 + 1e-6
    with pytest.raises(UsageError, match="is a DINOv2 depth head alone: give its backbone"):
        vitkit.load_depth_estimator(head)
    with pytest.raises(UsageError, match="max_depth is a DINOv2 head's deepest output, above 0"):
        vitkit.load_depth_estimator(head, backbone=_backbone(theirs, backbone), max_depth=-1)
    theirs.save_pretrained(tmp_path / "folder")
    with pytest.raises(UsageError, match="max_depth= is for a DINOv2 depth head file; .* records its own range"):
        vitkit.load_depth_estimator(tmp_path / "folder", max_depth=5)
    wider = vitkit.create_model("vit_small_patch14_dinov2", num_classes=0, img_size=56, depth=4)
    vitkit.save_pretrained(wider, tmp_path / "wider")
    with pytest.raises(CheckpointError, match="reads maps 64 wide in all; the backbone's are 384 wide"):
        vitkit.load_depth_estimator(head, backbone=tmp_path / "wider")


@pytest.mark.parametrize("layers", [1, 4])
def test_a_dinov2_linear_head_file_gives_the_expected_depth_over_its_bins(tmp_path, layers):
    theirs = _dpt_dinov2().backbone  # transformers' DINOv2: each block's tokens, class token first
    conv = torch.nn.Conv2d(2 * 64 * layers, 256, 1)
    _drawn(conv, 0.05)
    head = tmp_path / f"dinov2_vits14_kitti_linear{4 if layers == 4 else ''}_head.pth"
    torch.save({"state_dict": {"decode_head.conv_depth.weight": conv.weight, "decode_head.conv_depth.bias":
                               conv.bias}}, head)
    ours = vitkit.load_depth_estimator(head, backbone=_backbone(_dpt_dinov2(), tmp_path / "backbone.pth")).eval()
    assert ours.head.max_depth == 80.0 and ours.indices == ([0, 1, 2, 3] if layers == 4 else [3])
    x = torch.randn(2, 3, 42, 70, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # Meta's BNHead and depther, step by step on transformers' blocks
        states = theirs(x, output_hidden_states=True).hidden_states[1:]
        states = states if layers == 4 else states[-1:]
        maps = [torch.cat([s[:, 1:].transpose(1, 2).reshape(2, 64, 3, 5), s[:, 0, :, None, None].expand(2, 64, 3, 5)],
                          1) for s in states]
        feats = torch.cat([F.interpolate(m, size=(12, 20), mode="bilinear", align_corners=False) for m in maps], 1)
        p = torch.relu(conv(feats)) + 0.1
        depth = torch.einsum("ikmn,k->imn", p / p.sum(1, keepdim=True), torch.linspace(1e-3, 80, 256))
        expected = _at_input(depth.clamp(1e-3, 80), (42, 70))
        got = ours(x)
    assert expected.std() > 0.01
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_what_vitkit_does_not_read_of_dpt_is_refused_in_one_line(tmp_path):
    cfg = {"model_type": "dpt", "is_hybrid": True, "neck_hidden_sizes": [8, 16, 24, 32]}
    (tmp_path / "config.json").write_text(__import__("json").dumps(cfg))
    with pytest.raises(CheckpointError, match=r"a DPT on a DPT-Hybrid \(BiT\) backbone; vitkit reads DPT's own ViT"):
        vitkit.load_depth_estimator(tmp_path)
    torch.save({"state_dict": {"decode_head.conv_seg.weight": torch.zeros(3, 8, 1, 1)}}, tmp_path / "seg.pth")
    with pytest.raises(CheckpointError, match="is not a DINOv2 depth head vitkit reads"):
        vitkit.load_depth_estimator(tmp_path / "seg.pth", backbone=tmp_path / "seg.pth")


@pytest.mark.slow  # an ONNX export and onnxruntime at several sizes
def test_a_dpt_dinov2_folder_exports_with_its_resizes_at_every_size(tmp_path, capsys):
    """``vitkit export`` and ``predict`` take the folder as they take a run's checkpoint."""
    ort = pytest.importorskip("onnxruntime")
    from PIL import Image

    from tests.commands import run_cli

    theirs = _dpt_dinov2()
    theirs.save_pretrained(tmp_path / "dpt")
    status, err = run_cli(["export", str(tmp_path / "dpt"), "-o", str(tmp_path / "dpt.onnx")], capsys)
    assert status == 0, err  # exported at the preset's size: an even grid, every resize a no-op
    meta = {p.key: p.value for p in __import__("onnx").load(str(tmp_path / "dpt.onnx")).metadata_props}
    assert meta["vitkit.model"] == "dpt"  # the folder's name, not its backbone preset's
    session = ort.InferenceSession(str(tmp_path / "dpt.onnx"))
    x = torch.randn(1, 3, 42, 70, generator=torch.Generator().manual_seed(1))  # a 3 x 5 grid: DPT's path outgrows it
    (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        expected = _at_input(theirs(pixel_values=x).predicted_depth, (42, 70))
    torch.testing.assert_close(torch.from_numpy(got), expected, atol=1e-4, rtol=1e-4)
    Image.fromarray((np.random.default_rng(0).random((40, 70, 3)) * 255).astype(np.uint8)).save(tmp_path / "a.png")
    status, err = run_cli(["predict", str(tmp_path / "a.png"), "--checkpoint", str(tmp_path / "dpt"), "-o",
                           str(tmp_path / "out")], capsys)
    assert status == 0, err
    assert np.load(tmp_path / "out" / "a_depth.npy").shape == (40, 70)
