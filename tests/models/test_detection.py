"""Detectors (``vitkit.models.detection``): transformers' YolosForObjectDetection folders load into vitkit's YOLOS,
which gives transformers' logits and boxes at the saved size and at others; the DETR set loss gives transformers'
loss on the same predictions and objects."""

from types import SimpleNamespace

import pytest
import torch

import vitkit
from vitkit.errors import CheckpointError, MissingFileError, UsageError
from vitkit.models.detection import YOLOS, DetectionOutput
from vitkit.tasks.detection.loss import SetLoss

transformers = pytest.importorskip("transformers")


def _yolos_folder(path, mid: bool):
    """A random YOLOS of transformers' (every weight drawn, the tokens and positions included), saved."""
    cfg = transformers.YolosConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64,
                                   image_size=[48, 64], patch_size=8, num_detection_tokens=5, num_labels=3,
                                   use_mid_position_embeddings=mid, id2label={0: "cat", 1: "dog", 2: "bird"})
    torch.manual_seed(0)
    theirs = transformers.YolosForObjectDetection(cfg).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.3)
    theirs.save_pretrained(path)
    return theirs


@pytest.mark.parametrize("mid", [True, False])
def test_a_transformers_yolos_folder_gives_its_logits_and_boxes_at_any_size(tmp_path, mid):
    theirs = _yolos_folder(tmp_path / "yolos", mid)
    ours = vitkit.load_detector(tmp_path / "yolos").eval()
    assert isinstance(ours, YOLOS) and ours.class_names == ["cat", "dog", "bird"] and (ours.mid_pos is None) != mid
    for size in [(48, 64), (64, 40), (32, 96)]:  # the saved size, then positions resized both ways
        x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            expected, got = theirs(pixel_values=x), ours(x)
        torch.testing.assert_close(got.logits, expected.logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got.boxes, expected.pred_boxes, atol=1e-4, rtol=1e-4)
        assert got.logits.shape == (2, 5, 4) and got.logits.std() > 0.1  # drawn weights: not a trivial output


def test_what_is_not_a_yolos_is_refused_in_one_line(tmp_path):
    ours_backbone = vitkit.create_model("vit_tiny_patch16_224", num_classes=0, img_size=32, patch_size=8)
    model = YOLOS(ours_backbone, num_classes=2, det_tokens=3)
    with pytest.raises(UsageError, match=r"multiples of the patch \(8 px\), got \(1, 3, 30, 32\)"):
        model(torch.randn(1, 3, 30, 32))
    with pytest.raises(UsageError, match="YOLOS takes a ViT with a class token"):
        YOLOS(vitkit.create_model("vit_tiny_patch16_224", num_classes=0, class_token=False, global_pool="avg"), 2)
    with pytest.raises(CheckpointError, match="expected a folder of transformers' YolosForObjectDetection"):
        vitkit.load_detector(tmp_path)
    with pytest.raises(MissingFileError, match="hustvl/yolos-tiny is not there: vitkit.load_detector reads a local"):
        vitkit.load_detector("hustvl/yolos-tiny")
    (tmp_path / "config.json").write_text('{"model_type": "vit"}')
    with pytest.raises(CheckpointError, match="model_type='vit'; vitkit reads detectors of model_type 'yolos', "
                                              "'rf_detr' and 'lw_detr'"):
        vitkit.load_detector(tmp_path)


def _objects(counts, classes, generator):
    out = []
    for n in counts:
        centre = torch.rand(n, 2, generator=generator) * 0.6 + 0.2
        size = torch.rand(n, 2, generator=generator) * 0.3 + 0.05
        labels = torch.randint(0, classes, (n,), generator=generator)
        out.append({"labels": labels, "boxes": torch.cat([centre, size], 1)})
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_set_loss_is_transformers_detr_loss(seed):
    """Matching and terms as transformers' DETR loss computes them (YOLOS's weights), an image without objects
    included; the loss's gradient reaches the logits and the boxes."""
    from transformers.loss.loss_for_object_detection import ForObjectDetectionLoss

    g = torch.Generator().manual_seed(seed)
    B, Q, K = 3, 7, 4
    logits = torch.randn(B, Q, K + 1, generator=g, requires_grad=True)
    boxes = (torch.rand(B, Q, 4, generator=g) * 0.5 + 0.25).requires_grad_(True)
    targets = _objects((2, 0, 5), K, g)
    config = SimpleNamespace(class_cost=1, bbox_cost=5, giou_cost=2, num_labels=K, eos_coefficient=0.1,
                             auxiliary_loss=False, bbox_loss_coefficient=5, giou_loss_coefficient=2)
    expected, parts, _ = ForObjectDetectionLoss(logits, [{"class_labels": t["labels"], "boxes": t["boxes"]}
                                                         for t in targets], "cpu", boxes, config)
    total, ours = SetLoss()(DetectionOutput(logits, boxes), targets)
    torch.testing.assert_close(total, expected)
    for theirs, mine in (("loss_ce", "class"), ("loss_bbox", "l1"), ("loss_giou", "giou")):
        torch.testing.assert_close(ours[mine], parts[theirs])
    total.backward()
    assert logits.grad.abs().sum() > 0 and boxes.grad.abs().sum() > 0


def test_each_earlier_layer_adds_its_own_matched_terms():
    backbone = vitkit.create_model("vit_tiny_patch16_224", num_classes=0, img_size=32, patch_size=8, depth=3)
    model = YOLOS(backbone, num_classes=2, det_tokens=4, aux_outputs=True)
    out = model(torch.randn(2, 3, 32, 32))
    assert len(out.aux) == 2 and out.aux[0][0].shape == out.logits.shape
    total, parts = SetLoss()(out, _objects((1, 2), 2, torch.Generator().manual_seed(0)))
    assert set(parts) == {"class", "l1", "giou", "class_0", "l1_0", "giou_0", "class_1", "l1_1", "giou_1"}
    assert out.loss is total


def test_targets_the_set_loss_cannot_take_are_refused_in_one_line():
    out = DetectionOutput(torch.randn(1, 4, 3), torch.rand(1, 4, 4))
    for target, says in (({"labels": torch.tensor([5]), "boxes": torch.rand(1, 4)}, "labels must be classes 0 to 1"),
                         ({"labels": torch.tensor([0]), "boxes": torch.tensor([[10.0, 10, 40, 30]])},
                          "boxes must be centre x, centre y, width, height relative"),
                         ({"labels": torch.tensor([0]), "boxes": torch.rand(4)}, "expected labels .M,. and boxes")):
        with pytest.raises(UsageError, match=says):
            SetLoss()(out, [target])


def test_layer_decay_ranks_the_backbones_blocks_and_gives_the_detection_parts_the_full_rate():
    from vitkit.training.optim import param_groups

    backbone = vitkit.create_model("vit_tiny_patch16_224", num_classes=0, img_size=32, patch_size=8, embed_dim=32,
                                   depth=3, num_heads=2)
    model = YOLOS(backbone, num_classes=3, det_tokens=4)
    scale = {n: (g["lr_scale"], g["weight_decay"]) for g in param_groups(model, 0.05, 0.5) for n in g["names"]}
    assert scale["backbone.patch_embed.proj.weight"] == (0.5 ** 4, 0.05)
    assert scale["backbone.blocks.0.attn.qkv.weight"][0] < scale["backbone.blocks.2.attn.qkv.weight"][0] < 1
    for new in ("det_token", "det_pos", "mid_pos", "class_head.layers.0.weight", "box_head.layers.2.weight"):
        assert scale[new][0] == 1.0
    assert scale["det_token"][1] == scale["mid_pos"][1] == scale["backbone.pos_embed"][1] == 0.0
    assert scale["class_head.layers.0.weight"][1] == 0.05
