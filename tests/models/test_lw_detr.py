"""LW-DETR (``vitkit.models.rf_detr`` with ``window_blocks``): transformers' LwDetrForObjectDetection folders load
into vitkit's RFDETR on LW-DETR's own ViT (no class token, windows of the image, layer scale) with the multi-scale
projector (batch norms, levels at half and twice the patch stride), and give transformers' logits and boxes at the
saved size and at others, in evaluation and in training (query groups, proposals, loss)."""

import pytest
import torch

import vitkit
from vitkit.errors import CheckpointError
from vitkit.models.rf_detr import RFDETR, RFDETRConfig
from vitkit.tasks.detection.loss import SetLoss

transformers = pytest.importorskip("transformers")


def _lw_detr_folder(path, dropout: float = 0.0):
    """A random LW-DETR of transformers' (4 blocks, two in windows; levels at 1/2 and 2x; every weight and batch-norm
    statistic moved off its start), saved."""
    backbone = dict(model_type="lw_detr_vit", hidden_size=64, num_hidden_layers=4, num_attention_heads=2, mlp_ratio=2,
                    patch_size=8, image_size=64, pretrain_image_size=48, window_block_indices=[0, 2],
                    out_indices=[1, 3, 4], num_windows=4)
    cfg = transformers.LwDetrConfig(backbone_config=backbone, projector_scale_factors=[0.5, 2.0], d_model=32,
                                    decoder_layers=2, decoder_self_attention_heads=4, decoder_cross_attention_heads=4,
                                    decoder_ffn_dim=64, num_queries=6, group_detr=3, c2f_num_blocks=2, num_labels=5,
                                    dropout=dropout, id2label={i: f"c{i}" for i in range(5)})
    torch.manual_seed(0)
    theirs = transformers.LwDetrForObjectDetection(cfg).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        for m in theirs.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.normal_(0, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    theirs.save_pretrained(path)
    return theirs


def test_a_transformers_lw_detr_folder_gives_its_logits_and_boxes_at_any_size(tmp_path):
    theirs = _lw_detr_folder(tmp_path / "lw")
    ours = vitkit.load_detector(tmp_path / "lw").eval()
    assert isinstance(ours, RFDETR) and ours.class_names == [f"c{i}" for i in range(5)] and len(ours.projector) == 2
    for size in [(64, 64), (64, 96), (96, 32)]:  # positions resampled from the 6 x 6 pre-training grid every time
        x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            expected, got = theirs(pixel_values=x), ours(x)
        torch.testing.assert_close(got.logits, expected.logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got.boxes, expected.pred_boxes, atol=1e-4, rtol=1e-4)
        assert got.logits.shape == (2, 6, 5) and got.logits.std() > 0.05


def test_in_training_its_groups_proposals_and_loss_are_transformers(tmp_path):
    theirs = _lw_detr_folder(tmp_path / "lw").train()
    ours = vitkit.load_detector(tmp_path / "lw").train()
    x = torch.randn(2, 3, 64, 96, generator=torch.Generator().manual_seed(2))
    two = torch.tensor([[0.3, 0.4, 0.2, 0.3], [0.7, 0.6, 0.3, 0.2]])
    labels = [{"class_labels": torch.tensor([1, 3]), "boxes": two},
              {"class_labels": torch.tensor([4]), "boxes": torch.tensor([[0.5, 0.5, 0.4, 0.4]])}]
    expected, got = theirs(pixel_values=x, labels=labels), ours(x)  # batch norms on the batch's statistics
    assert got.groups == 3 and got.logits.shape == (2, 18, 5)
    torch.testing.assert_close(got.logits, expected.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.boxes, expected.pred_boxes, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.enc[1], expected.enc_outputs_coord_logits, atol=1e-4, rtol=1e-4)
    total, _ = SetLoss()(got, [{"labels": t["class_labels"], "boxes": t["boxes"]} for t in labels])
    assert total.item() == pytest.approx(expected.loss.item(), rel=1e-4)
    total.backward()
    unused = {n for n, p in ours.named_parameters() if p.requires_grad and p.grad is None}
    assert unused == set() and not ours.backbone.norm.weight.requires_grad  # LW-DETR never runs the final norm


@pytest.mark.slow  # an ONNX export and onnxruntime at two sizes
def test_an_lw_detr_exports_with_its_levels_at_another_size(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    from vitkit.deploy.export import export_onnx
    from vitkit.models.detection import corners
    from vitkit.tasks.detection.inference import ExportedDetector

    theirs = _lw_detr_folder(tmp_path / "lw")
    ours = vitkit.load_detector(tmp_path / "lw").eval()
    export_onnx(ExportedDetector(ours, ours.backbone.name, ours.class_names).eval(), tmp_path / "lw.onnx")
    session = ort.InferenceSession(str(tmp_path / "lw.onnx"))
    x = torch.randn(1, 3, 96, 64, generator=torch.Generator().manual_seed(4))
    outputs = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    got = dict(zip([o.name for o in session.get_outputs()], outputs, strict=True))
    with torch.no_grad():
        expected = theirs(pixel_values=x)
    torch.testing.assert_close(torch.from_numpy(got["boxes"]), corners(expected.pred_boxes), atol=1e-4, rtol=1e-4)


def test_an_lw_detr_of_another_kind_is_refused_by_the_setting(tmp_path):
    _lw_detr_folder(tmp_path / "lw")
    config = (tmp_path / "lw" / "config.json")
    config.write_text(config.read_text().replace('"activation_function": "silu"', '"activation_function": "relu"'))
    with pytest.raises(CheckpointError, match=r"an RF-DETR with \{'activation_function': 'relu'\}"):
        vitkit.load_detector(tmp_path / "lw")


def test_lw_detrs_windows_take_a_vit_without_a_class_token_and_train_all_it_runs():
    """A SigLIP-style ViT (no class token, an attention pool the detector never runs): every trainable weight gets a
    gradient (DDP stops on one that does not), the pool and the final norm do not train."""
    vit = vitkit.create_model("vit_base_patch16_siglip_224", num_classes=0, img_size=64, patch_size=8, depth=4,
                              embed_dim=64, num_heads=2)
    cfg = RFDETRConfig(out_indices=(1, 2, 4), windows=2, d_model=32, queries=6, groups=2, self_heads=4,
                       cross_heads=4)
    model = RFDETR(vit, 3, cfg).train()
    out = model(torch.randn(2, 3, 64, 64))
    (out.logits.sum() + out.boxes.sum() + out.enc[0].sum() + out.enc[1].sum()).backward()
    assert [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None] == []
    assert not any(p.requires_grad for p in [*vit.attn_pool.parameters(), *vit.norm.parameters()])
