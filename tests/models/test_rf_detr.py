"""RF-DETR (``vitkit.models.rf_detr``): transformers' RfDetrForObjectDetection folders load into vitkit's RFDETR,
which gives transformers' logits, boxes and two-stage proposals at the saved size and at others, in evaluation and
in training (query groups); its loss is transformers' LW-DETR loss on the same predictions."""

import json

import numpy as np
import pytest
import torch

import vitkit
from vitkit.errors import CheckpointError, UsageError
from vitkit.models.rf_detr import RFDETR, RFDETRConfig, WindowedViT
from vitkit.tasks.detection.loss import SetLoss

transformers = pytest.importorskip("transformers")


def _rf_detr_folder(path, dropout: float = 0.1, hidden: int = 48, heads: int = 3, eps: float = 1e-5, **backbone_config):
    """A random RF-DETR of transformers' (every weight moved off its start), windowed, saved."""
    backbone = dict(model_type="rf_detr_dinov2", hidden_size=hidden, num_hidden_layers=4, num_attention_heads=heads,
                    mlp_ratio=2, patch_size=8, image_size=64, out_features=["stage1", "stage2", "stage4"],
                    num_windows=2)
    backbone.update(backbone_config)
    cfg = transformers.RfDetrConfig(backbone_config=backbone, d_model=32, decoder_layers=2, layer_norm_eps=eps,
                                    decoder_self_attention_heads=4, decoder_cross_attention_heads=4,
                                    decoder_ffn_dim=64, num_queries=6, group_detr=3, c2f_num_blocks=2, num_labels=5,
                                    dropout=dropout, id2label={i: f"c{i}" for i in range(5)})
    torch.manual_seed(0)
    theirs = transformers.RfDetrForObjectDetection(cfg).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    theirs.save_pretrained(path)
    return theirs


def test_a_transformers_rf_detr_folder_gives_its_logits_and_boxes_at_any_size(tmp_path):
    theirs = _rf_detr_folder(tmp_path / "rf")
    ours = vitkit.load_detector(tmp_path / "rf").eval()
    assert isinstance(ours, RFDETR) and ours.class_names == [f"c{i}" for i in range(5)]
    for size in [(64, 64), (64, 96), (96, 32)]:  # the saved size, then windows of other shapes, positions resized
        x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            expected, got = theirs(pixel_values=x), ours(x)
        torch.testing.assert_close(got.logits, expected.logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got.boxes, expected.pred_boxes, atol=1e-4, rtol=1e-4)
        assert got.sigmoid and got.logits.shape == (2, 6, 5) and got.logits.std() > 0.05  # not a trivial output


def test_an_rf_detr_checkpoint_of_its_own_code_gives_the_same_detections(tmp_path):
    from argparse import Namespace
    from pathlib import PosixPath

    from safetensors.torch import load_file

    # RF-DETR's own files: its names (transformers writes the same), DINOv2's 64-wide heads, LayerNorms at 1e-6
    theirs = _rf_detr_folder(tmp_path / "rf", hidden=128, heads=2, eps=1e-6)
    c = theirs.config
    args = Namespace(encoder="dinov2_windowed_small", out_feature_indexes=[1, 2, 4], num_windows=2, patch_size=8,
                     positional_encoding_size=8, hidden_dim=32, dec_layers=2, sa_nheads=4, ca_nheads=4,
                     dec_n_points=c.decoder_n_points, dim_feedforward=64, num_queries=6, group_detr=3,
                     projector_scale=["P4"], layer_norm=True, two_stage=True, bbox_reparam=True,
                     lite_refpoint_refine=True, class_names=[f"c{i}" for i in range(5)], dropout=0.0,
                     output_dir=PosixPath("output"))
    weights = load_file(tmp_path / "rf" / "model.safetensors")
    torch.save({"model": weights, "args": args, "epoch": 11, "optimizer": {"state": {}}}, tmp_path / "rf.pth")
    ours = vitkit.load_detector(tmp_path / "rf.pth").eval()
    from vitkit.tasks import registry

    assert registry.for_checkpoint(str(tmp_path / "rf.pth")).name == "detection"  # the commands take it
    torch.save({"model": weights}, tmp_path / "other.pth")  # no settings: not RF-DETR's, the classifier's reading
    assert registry.for_checkpoint(str(tmp_path / "other.pth")).name == "classification"
    assert ours.class_names == args.class_names and ours.cfg.windows == 2 and ours.cfg.projector_eps == 1e-6
    x = torch.randn(2, 3, 64, 96, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected, got = theirs(pixel_values=x), ours(x)
    torch.testing.assert_close(got.logits, expected.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.boxes, expected.pred_boxes, atol=1e-4, rtol=1e-4)
    args.projector_scale = ["P5", "P3"]
    torch.save({"model": weights, "args": args}, tmp_path / "large.pth")
    with pytest.raises(CheckpointError, match=r"projector_scale \['P5', 'P3'\]; vitkit reads levels of P3, P4 and P5"):
        vitkit.load_detector(tmp_path / "large.pth")


PROJECTOR_TO_RF_DETR = [  # vitkit's projector -> RF-DETR's own names (MultiScaleProjector: stages, stages_sampling)
    (r"^projector\.(\d+)\.conv([12])\.norm\.", r"backbone.0.projector.stages.\1.0.cv\2.bn."),
    (r"^projector\.(\d+)\.conv([12])\.", r"backbone.0.projector.stages.\1.0.cv\2."),
    (r"^projector\.(\d+)\.bottlenecks\.(\d+)\.conv([12])\.norm\.", r"backbone.0.projector.stages.\1.0.m.\2.cv\3.bn."),
    (r"^projector\.(\d+)\.bottlenecks\.(\d+)\.conv([12])\.", r"backbone.0.projector.stages.\1.0.m.\2.cv\3."),
    (r"^projector\.(\d+)\.norm\.", r"backbone.0.projector.stages.\1.1."),
    (r"^projector\.(\d+)\.samplers\.(\d+)\.(\d+)\.norm\.", r"backbone.0.projector.stages_sampling.\1.\2.\3.bn."),
    (r"^projector\.(\d+)\.samplers\.(\d+)\.(\d+)\.", r"backbone.0.projector.stages_sampling.\1.\2.\3."),
]


def test_an_rf_detr_checkpoint_of_p3_and_p5_levels_gives_the_model_it_describes(tmp_path):
    """The deprecated Large's projector: levels at twice and half the patch grid (``projector_scale: [P3, P5]``),
    RF-DETR's own samplers (no LW-DETR 1x1 before a wide map's transposed conv) and a decoder over two levels."""
    import re
    from argparse import Namespace
    from dataclasses import replace

    from safetensors.torch import load_file

    from vitkit.checkpoints.detection import read_detector

    c = _rf_detr_folder(tmp_path / "rf", hidden=128, heads=2, eps=1e-6).config  # RF-DETR's names for its parts
    weights = load_file(tmp_path / "rf" / "model.safetensors")
    args = Namespace(encoder="dinov2_windowed_small", out_feature_indexes=[1, 2, 4], num_windows=2, patch_size=8,
                     positional_encoding_size=8, hidden_dim=32, dec_layers=2, sa_nheads=4, ca_nheads=4,
                     dec_n_points=c.decoder_n_points, dim_feedforward=64, num_queries=6, group_detr=3, layer_norm=True,
                     two_stage=True, bbox_reparam=True, lite_refpoint_refine=True, projector_scale=["P4"])
    torch.save({"model": weights, "args": args}, tmp_path / "p4.pth")
    found = read_detector(tmp_path / "p4.pth")
    one = vitkit.load_detector(tmp_path / "p4.pth").eval()
    # where each vitkit weight is in the file, by their values: a key, or a third of one (the decoder's packed
    # in_proj), or three keys (the backbone's q, k and v, fused in vitkit)
    thirds = {(k, i): t for k, v in weights.items() for i, t in enumerate(v.chunk(3)) if "in_proj" in k}
    theirs = {}
    for name, tensor in found.state_dict.items():
        parts = tensor.chunk(3) if ".attn.qkv." in name else (tensor,)
        theirs[name] = [next(((k, None) for k, v in weights.items() if v.shape == t.shape and torch.equal(v, t)),
                             None) or next(k for k, v in thirds.items() if v.shape == t.shape and torch.equal(v, t))
                        for t in parts]
    cfg = replace(one.cfg, scales=(2.0, 0.5), reduce_wide=False)
    torch.manual_seed(1)
    large = RFDETR(one.backbone, 5, cfg).eval()
    with torch.no_grad():
        for p in large.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    file, packed = {}, {}
    for name, tensor in large.state_dict().items():
        if name.startswith("projector."):
            file[next(re.sub(a, b, name) for a, b in PROJECTOR_TO_RF_DETR if re.match(a, name))] = tensor
            continue
        for (key, third), part in zip(theirs[name], tensor.chunk(len(theirs[name])), strict=True):
            if third is None:
                file[key] = part
            else:
                packed.setdefault(key, {})[third] = part
    file.update({k: torch.cat([p[i] for i in range(3)]) for k, p in packed.items()})
    assert any(".stages_sampling.1.2.0.bn." in k for k in file)  # P5's strided ConvX on the third map
    args.projector_scale = ["P3", "P5"]
    torch.save({"model": file, "args": args}, tmp_path / "large.pth")
    loaded = vitkit.load_detector(tmp_path / "large.pth").eval()
    assert loaded.cfg.scales == (2.0, 0.5) and not loaded.cfg.reduce_wide
    x = torch.randn(2, 3, 64, 96, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected, got = large(x), loaded(x)
    torch.testing.assert_close(got.logits, expected.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.boxes, expected.boxes, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got.logits, one(x).logits, atol=1e-3)  # not the one-level model's detections


def test_the_blocks_a_folder_names_for_windows_attend_within_them(tmp_path):
    theirs = _rf_detr_folder(tmp_path / "rf", window_block_indexes=[0, 2])  # not RF-DETR's rule (0 and 3)
    ours = vitkit.load_detector(tmp_path / "rf").eval()
    assert ours.cfg.window_blocks == (0, 2) and ours.windowed.global_blocks == {1, 3}
    x = torch.randn(1, 3, 64, 96, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected, got = theirs(pixel_values=x), ours(x)
    torch.testing.assert_close(got.logits, expected.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.boxes, expected.pred_boxes, atol=1e-4, rtol=1e-4)


def test_in_training_its_groups_proposals_and_loss_are_transformers(tmp_path):
    theirs = _rf_detr_folder(tmp_path / "rf", dropout=0.0).train()
    ours = vitkit.load_detector(tmp_path / "rf").train()
    for m in ours.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    x = torch.randn(2, 3, 64, 96, generator=torch.Generator().manual_seed(2))
    two = torch.tensor([[0.3, 0.4, 0.2, 0.3], [0.7, 0.6, 0.3, 0.2]])
    labels = [{"class_labels": torch.tensor([1, 3]), "boxes": two},
              {"class_labels": torch.tensor([4]), "boxes": torch.tensor([[0.5, 0.5, 0.4, 0.4]])}]
    expected, got = theirs(pixel_values=x, labels=labels), ours(x)
    assert got.groups == 3 and got.logits.shape == (2, 18, 5) and len(got.aux) == 1
    torch.testing.assert_close(got.logits, expected.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.boxes, expected.pred_boxes, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.enc[0], expected.enc_outputs_class, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.enc[1], expected.enc_outputs_coord_logits, atol=1e-4, rtol=1e-4)
    total, parts = SetLoss()(got, [{"labels": t["class_labels"], "boxes": t["boxes"]} for t in labels])
    names = {"class": "loss_ce", "l1": "loss_bbox", "giou": "loss_giou"}
    for ours_name, value in parts.items():
        term, _, suffix = ours_name.partition("_")
        theirs_name = names[term] + (f"_{suffix}" if suffix else "")
        assert value.item() == pytest.approx(expected.loss_dict[theirs_name].item(), rel=1e-4, abs=1e-6), ours_name
    assert total.item() == pytest.approx(expected.loss.item(), rel=1e-4)
    total.backward()  # every part learns: the backbone, the projector, the proposals' heads, the decoder
    assert all(p.grad is not None for p in ours.parameters())


def test_what_rf_detr_cannot_take_is_refused_in_one_line(tmp_path):
    vit = vitkit.create_model("vit_tiny_patch16_224", num_classes=0, img_size=64, patch_size=8, depth=4)
    model = RFDETR(vit, 3, RFDETRConfig(out_indices=(1, 2, 4), windows=2, d_model=32, queries=6, groups=2,
                                        self_heads=4, cross_heads=4))
    with pytest.raises(UsageError, match=r"multiples of 16 px \(the 8 px patch x 2 windows\), got 64 x 56"):
        model(torch.randn(1, 3, 64, 56))
    with pytest.raises(UsageError, match=r"selects 6 queries from the maps' 4 positions \(2 x 2\)"):
        model.eval()(torch.randn(1, 3, 16, 16))
    with pytest.raises(UsageError, match=r"out_indices must be stages 1 to 4"):
        RFDETR(vit, 3, RFDETRConfig(out_indices=(2, 5)))
    merging = vitkit.create_model("vit_tiny_patch16_224", num_classes=0, img_size=64, patch_size=8, depth=4,
                                  token_merging=2)
    with pytest.raises(UsageError, match="RF-DETR runs its backbone's blocks in windows, without token merging"):
        RFDETR(merging, 3, RFDETRConfig(out_indices=(1, 2, 4), windows=2))
    with pytest.raises(UsageError, match="d_model \\(30\\) must be divisible by self_heads"):
        RFDETRConfig(d_model=30)
    _rf_detr_folder(tmp_path / "rf")
    config = json.loads((tmp_path / "rf/config.json").read_text())
    (tmp_path / "rf/config.json").write_text(json.dumps({**config, "activation_function": "relu"}))
    with pytest.raises(CheckpointError, match=r"an RF-DETR with \{'activation_function': 'relu'\}; vitkit builds"):
        vitkit.load_detector(tmp_path / "rf")
    config["backbone_config"]["model_type"] = "rf_detr_vit"
    (tmp_path / "rf/config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="an RF-DETR on a 'rf_detr_vit' backbone; vitkit reads the DINOv2"):
        vitkit.load_detector(tmp_path / "rf")


def test_a_state_dict_of_the_one_level_projector_loads_into_the_levels():
    vit = vitkit.create_model("vit_tiny_patch16_224", num_classes=0, img_size=64, patch_size=8, depth=2)
    cfg = RFDETRConfig(out_indices=(1, 2), windows=2, d_model=32, queries=6, groups=2, self_heads=4, cross_heads=4)
    model = RFDETR(vit, 3, cfg).eval()
    before = {k.replace("projector.0.", "projector."): v for k, v in model.state_dict().items()}  # earlier runs' keys
    assert "projector.conv1.conv.weight" in before
    fresh = RFDETR(vitkit.create_model("vit_tiny_patch16_224", num_classes=0, img_size=64, patch_size=8, depth=2), 3,
                   cfg).eval()
    fresh.load_state_dict(before)
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(fresh(x).boxes, model(x).boxes)


def test_the_commands_read_an_rf_detr_folder_at_its_windows_size(tmp_path, capsys):
    """vitkit predict and export take a transformers folder as a run's checkpoint: its positions made at 56 px (7
    patches, as RF-DETR Base's at 518), its letterbox whole windows (64 px, as RF-DETR Base's 560)."""
    from PIL import Image

    from tests.commands import run_cli

    _rf_detr_folder(tmp_path / "rf", image_size=56)
    Image.fromarray((np.random.default_rng(0).random((40, 70, 3)) * 255).astype(np.uint8)).save(tmp_path / "a.png")
    status, err = run_cli(["predict", str(tmp_path / "a.png"), "--checkpoint", str(tmp_path / "rf"), "--threshold",
                           "0", "-o", str(tmp_path / "found")], capsys)
    assert status == 0, err
    found = json.loads((tmp_path / "found" / "a_detections.json").read_text())
    assert len(found) == 6 and {d["label"] for d in found} <= {f"c{i}" for i in range(5)}


WINDOWED = {  # backbones whose windows carry more than a class token and learned positions
    "dinov3": dict(pos_embed="none", rope="dinov3", reg_tokens=4),  # rotary positions alone, registers
    "eva02": dict(rope="axial", rope_ref_grid=8),  # learned and rotary positions
    "dinov2_reg": dict(reg_tokens=4, no_embed_class=True),  # registers, positions on the patches only
}


@pytest.mark.parametrize("kind", sorted(WINDOWED))
def test_rf_detrs_windows_carry_registers_and_rotary_positions(kind):
    """One window is the ViT's own forward; in windows, each window is the ViT run on its patches alone (MAE's
    ``keep`` path: the prefix tokens, those patches' positions and rotary rows), and RF-DETR trains on it."""
    torch.manual_seed(0)
    vit = vitkit.create_model("vit_tiny_patch16_224", num_classes=0, img_size=64, patch_size=8, depth=4,
                              embed_dim=64, num_heads=2, **WINDOWED[kind]).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        whole = WindowedViT(vit, (1, 2, 4), 1)(vit, x)
        expected = vit.forward_intermediates(x, indices=[0, 1, 3], norm=True, intermediates_only=True)
        for a, b in zip(whole, expected, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        windowed = WindowedViT(vit, (4,), 2, window_blocks=(0, 1, 2, 3))(vit, x)[0]  # (2, C, 8, 8)
        patches = vit.patch_embed(x)
        for i in range(2):
            for j in range(2):
                rows, cols = range(4 * i, 4 * i + 4), range(4 * j, 4 * j + 4)
                keep = torch.tensor([r * 8 + c for r in rows for c in cols]).expand(2, -1)
                tokens, rope = vit.embed_tokens(patches, (8, 8), keep=keep, resample=True)
                for k, blk in enumerate(vit.blocks):
                    tokens = blk(tokens, rope=vit._layer_rope(rope, k))
                alone = vit.norm(tokens)[:, vit.num_prefix_tokens:].reshape(2, 4, 4, -1).permute(0, 3, 1, 2)
                torch.testing.assert_close(windowed[:, :, 4 * i:4 * i + 4, 4 * j:4 * j + 4], alone, atol=1e-5,
                                           rtol=1e-5)
    cfg = RFDETRConfig(out_indices=(1, 2, 4), windows=2, d_model=32, queries=6, groups=2, self_heads=4,
                       cross_heads=4, decoder_layers=2, ffn_dim=64)
    model = RFDETR(vit, 3, cfg).train()
    boxes = torch.tensor([[0.4, 0.45, 0.4, 0.5]])  # cx cy w h
    targets = [{"boxes": boxes, "labels": torch.tensor([1])}, {"boxes": boxes, "labels": torch.tensor([2])}]
    SetLoss()(model(x), targets)[0].backward()
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all(model.get_parameter(n).grad is not None for n in trained)
    with torch.no_grad():  # another size: positions resampled, rotary rows of the larger grid
        assert model.eval()(torch.randn(1, 3, 64, 96)).boxes.shape == (1, 6, 4)


@pytest.mark.slow
def test_rf_detr_reads_a_swins_stages_at_stride_16_trains_and_exports_at_another_size(tmp_path):
    """A Swin's stages 2 to 4 (strides 8, 16, 32): each map brought to stage 3's grid (stride 16: RF-DETR's P4), the
    stage there read as it is; every weight it runs learns, the unread final norm and head do not train; sides are
    multiples of stage 4's stride, refused in one line otherwise; the ONNX export takes another multiple."""
    ort = pytest.importorskip("onnxruntime")
    from vitkit.deploy.export import export_onnx
    from vitkit.tasks.detection.inference import ExportedDetector

    torch.manual_seed(0)
    swin = vitkit.create_model("swin_tiny_patch4_window7_224", num_classes=0, img_size=64, embed_dim=16,
                               depths=(1, 1, 1, 1), num_heads=(1, 1, 2, 2), window_size=4)
    cfg = RFDETRConfig(out_indices=(2, 3, 4), d_model=32, queries=6, groups=2, self_heads=4, cross_heads=4,
                       decoder_layers=1, ffn_dim=64)
    model = RFDETR(swin, 3, cfg)
    assert (model.img_multiple, model.map_stride, model.windowed.widths) == (32, 16, [32, 64, 128])
    x = torch.randn(2, 3, 64, 96)
    with torch.no_grad():
        maps = model.windowed(swin, x)
        stage3 = swin.forward_intermediates(x, indices=[2], intermediates_only=True)[0]
    assert [tuple(m.shape) for m in maps] == [(2, 32, 4, 6), (2, 64, 4, 6), (2, 128, 4, 6)]
    torch.testing.assert_close(maps[1], stage3)
    boxes = torch.tensor([[0.4, 0.45, 0.4, 0.5]])
    SetLoss()(model.train()(x), [{"boxes": boxes, "labels": torch.tensor([1])}] * 2)[0].backward()
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(model.get_parameter(n).grad is not None for n in trained)
    assert not any(n.startswith("backbone.norm.") for n in trained)
    with pytest.raises(UsageError, match=r"multiples of 32 px \(the stride of swin_tiny_patch4_window7_224's stage "
                                         r"4\), got 64 x 80"):
        model(torch.randn(1, 3, 64, 80))
    with pytest.raises(UsageError, match="window_blocks name a plain ViT's blocks"):
        RFDETR(swin, 3, RFDETRConfig(out_indices=(2, 3, 4), window_blocks=(0,)))
    model.eval()
    export_onnx(ExportedDetector(model, swin.name, ["a", "b", "c"]).eval(), tmp_path / "swin.onnx")
    session = ort.InferenceSession(str(tmp_path / "swin.onnx"))
    other = torch.randn(1, 3, 96, 64)
    got = session.run(None, {session.get_inputs()[0].name: other.numpy()})
    with torch.no_grad():
        expected = ExportedDetector(model, swin.name, ["a", "b", "c"]).eval()(other)
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(a, b.numpy(), atol=1e-4, rtol=1e-4)
