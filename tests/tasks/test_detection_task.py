"""The detection task: COCO and YOLO folders read into letterboxed batches whose boxes map back to the images' own
pixels, COCO's scores as pycocotools computes them, and a detector that learns its scenes and that train, predict,
evaluate and export read through the task protocol."""

import csv
import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

import vitkit
from tests.commands import error_line_of, run_cli
from vitkit.cli import main
from vitkit.data.modules.detection import DetectionDataModule, HFDetectionDataModule
from vitkit.errors import CheckpointError, UsageError
from vitkit.evaluation.detection import average_precision, coco_files, scores
from vitkit.models.detection import truths

from .detection_scenes import NAMES, scenes, write_coco, write_hf, write_voc, write_yolo

TINY = '{"patch_size": 8, "embed_dim": 64, "depth": 2, "num_heads": 2}'
# a tiny model's steps to learn 8 scenes by heart: the recipe's LR for a pretrained backbone, 10x, without its
# warmup, layer decay and average
MEMORISE = {"lr": 1e-3, "lr_batch": None, "warmup_epochs": 0, "min_lr": 1e-3, "layer_decay": None, "ema_decay": None,
            "ema_is_model": False}


def _module(root, **kw) -> DetectionDataModule:
    dm = DetectionDataModule(str(root), img_size=64, batch_size=4, num_workers=0, **kw)
    dm.setup("fit")
    return dm


def test_a_coco_and_a_yolo_folder_of_the_same_scenes_give_the_same_batches(tmp_path):
    coco = _module(write_coco(tmp_path / "coco", {"train": 6, "val": 5}))
    yolo = _module(write_yolo(tmp_path / "yolo", {"train": 6, "val": 5}))
    assert coco.layout == "coco" and yolo.layout == "yolo" and coco.classes == yolo.classes == NAMES
    (xc, tc), (xy, ty) = (next(iter(dm.val_dataloader())) for dm in (coco, yolo))
    assert torch.equal(xc, xy) and xc.dtype == torch.uint8 and xc.shape == (4, 3, 64, 64)
    for a, b in zip(tc, ty, strict=True):
        assert torch.equal(a["labels"], b["labels"]) and torch.equal(a["size"], b["size"])
        torch.testing.assert_close(a["boxes"], b["boxes"], atol=1e-5, rtol=0)


def test_a_voc_folder_and_a_hugging_face_dataset_give_the_batches_of_a_coco_folder(tmp_path):
    coco = _module(write_coco(tmp_path / "coco", {"train": 6, "val": 5}))
    voc = _module(write_voc(tmp_path / "voc", {"train": 6, "val": 5}), names=NAMES)
    hf = HFDetectionDataModule(str(write_hf(tmp_path / "hf", {"train": 6, "val": 5})), img_size=64, batch_size=4,
                               num_workers=0)  # its "val" split found as the validation split
    hf.setup("fit")
    assert voc.layout == "voc" and hf.classes == voc.classes == NAMES and hf.test_set is None
    assert len(hf.train_set) == len(voc.train_set) == 6
    expected = list(coco.val_dataloader())
    for dm in (voc, hf):
        for (xc, tc), (x, t) in zip(expected, dm.val_dataloader(), strict=True):
            assert torch.equal(xc, x)
            for a, b in zip(tc, t, strict=True):
                assert torch.equal(a["labels"], b["labels"]) and torch.equal(a["size"], b["size"])
                torch.testing.assert_close(a["boxes"], b["boxes"], atol=1e-5, rtol=0)
    carved = HFDetectionDataModule(str(write_hf(tmp_path / "hf_train", {"train": 6})), val_fraction=0.5, img_size=64)
    assert len(carved.rows["train"]) + len(carved.rows["val"]) == 6 and len(carved.rows["val"]) == 3
    with pytest.raises(UsageError, match="has no column 'boxes'.*its columns are image, objects"):
        HFDetectionDataModule(str(tmp_path / "hf"), objects_column="boxes", img_size=64)


def test_a_letterboxed_box_times_the_images_longer_side_is_its_box_in_pixels(tmp_path):
    root = write_coco(tmp_path, {"train": 4, "val": 12})
    dm = _module(root)
    truth = json.loads((root / "annotations/val.json").read_text())
    shapes = {(img["height"], img["width"]) for img in truth["images"]}
    assert len(shapes) > 1  # images of their own aspect ratios, not squares alone
    seen = 0
    for x, targets in dm.val_dataloader():
        for t, pixels in zip(targets, truths(targets, 64), strict=True):
            image = truth["images"][seen]
            assert tuple(t["size"].tolist()) == (image["height"], image["width"])
            boxes = [a["bbox"] for a in truth["annotations"] if a["image_id"] == image["id"]]
            expected = torch.tensor([[b[0], b[1], b[0] + b[2], b[1] + b[3]] for b in boxes]).reshape(-1, 4)
            torch.testing.assert_close(pixels["boxes"], expected, atol=1e-3, rtol=0)
            seen += 1
        assert (x[:, :, :, 64:] == 0).all()  # padded at the right and bottom, never shifted
    assert seen == 12


def test_a_flipped_training_image_carries_its_boxes(tmp_path):
    root = write_coco(tmp_path, {"train": 3, "val": 3})
    flipped = DetectionDataModule(str(root), img_size=64, hflip=1.0, num_workers=0).split("train", True)
    plain = DetectionDataModule(str(root), img_size=64, hflip=0.0, num_workers=0).split("train", True)
    for i in range(3):
        (xf, tf), (xp, tp) = flipped[i], plain[i]
        h, w = tp["size"].tolist()
        side, width = max(h, w), w / max(h, w)  # the image's width relative to the letterbox
        torch.testing.assert_close(tf["boxes"][:, 0], width - tp["boxes"][:, 0], atol=1e-5, rtol=0)
        torch.testing.assert_close(tf["boxes"][:, 1:], tp["boxes"][:, 1:], atol=1e-5, rtol=0)
        cols = round(width * 64)
        assert torch.equal(xf[..., :cols], xp[..., :cols].flip(-1)) or side != 64  # the pixels flipped alike


def test_an_image_without_objects_and_a_crowd_region_are_kept(tmp_path):
    root = write_coco(tmp_path, {"train": 4, "val": 2})
    data = json.loads((root / "annotations/train.json").read_text())
    Image.fromarray(np.zeros((64, 64, 3), np.uint8)).save(root / "train" / "empty.png")
    data["images"].append({"id": 99, "file_name": "empty.png", "height": 64, "width": 64})
    data["annotations"][0]["iscrowd"] = 1
    (root / "annotations/train.json").write_text(json.dumps(data))
    ds = DetectionDataModule(str(root), img_size=64, num_workers=0).split("train", False)
    assert len(ds) == 5 and len(ds[4][1]["boxes"]) == 0
    assert ds[0][1]["iscrowd"].tolist()[0] is True


def test_coco_scores_are_pycocotools_cocoeval_on_the_written_files(tmp_path):
    """torchmetrics' scores on the installed COCO code equal pycocotools' own COCOeval on the truth and
    predictions vitkit writes (COCO's formats), overall and per class."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    g = torch.Generator().manual_seed(0)
    preds, gts, sizes = [], [], []
    for image, boxes, labels in scenes(30, 96, seed=3, scale=(8, 60)):
        true = torch.from_numpy(boxes)
        noisy = torch.cat([true + torch.randn(true.shape, generator=g) * 3, torch.rand(3, 4, generator=g) * 60])
        noisy = torch.cat([noisy[:, :2], torch.maximum(noisy[:, 2:], noisy[:, :2] + 1)], dim=1).clamp(min=0)
        found = torch.cat([torch.from_numpy(labels), torch.randint(0, 10, (3,), generator=g)])
        found[torch.rand(len(found), generator=g) < 0.2] = 3  # some wrong classes
        preds.append({"boxes": noisy, "scores": torch.rand(len(noisy), generator=g), "labels": found})
        gts.append({"boxes": true, "labels": torch.from_numpy(labels), "iscrowd": torch.zeros(len(labels))})
        sizes.append(image.shape[:2])
    metric = average_precision(class_metrics=True)
    metric.update(preds, gts)
    ours = scores(metric.compute(), NAMES)
    coco_files(preds, gts, sizes, NAMES, tmp_path)
    truth = COCO(str(tmp_path / "truth.json"))
    run = COCOeval(truth, truth.loadRes(str(tmp_path / "predictions.json")), "bbox")
    run.evaluate()
    run.accumulate()
    run.summarize()
    names = ["mAP", "AP50", "AP75", "AP_small", "AP_medium", "AP_large", "AR1", "AR10", "AR100"]
    for name, value in zip(names, run.stats[:9], strict=True):
        assert ours[name] == pytest.approx(value, abs=1e-6), name
    assert 0.05 < ours["mAP"] < 0.95  # neither empty nor perfect: the comparison says something
    precision = run.eval["precision"][:, :, :, 0, -1]  # per class: mean over IoUs and recalls with values
    for k, name in enumerate(NAMES):
        p = precision[:, :, k]
        assert ours[f"AP/{name}"] == pytest.approx(float(p[p > -1].mean()), abs=1e-6), name


@pytest.fixture(scope="module")
def learned(tmp_path_factory):
    """A tiny detector trained on 8 scenes until it knows them (its validation split is the same 8 scenes); the
    classes' COCO ids have gaps (1, 4, 7, ...), as COCO's own."""
    root = write_coco(tmp_path_factory.mktemp("scenes"), {"train": 8}, seed=5, step=3)
    shutil.copytree(root / "train", root / "val")
    shutil.copy(root / "annotations/train.json", root / "annotations/val.json")
    run = tmp_path_factory.mktemp("run")
    status = main(["train", "fit", "-c", "det_yolos_finetune", "--data.root", str(root),
                           "--model.model_name", "vit_tiny_patch16_224", "--model.model_overrides", TINY,
                           "--model.det_tokens", "8", "--model.recipe", json.dumps(MEMORISE),
                           "--data.img_size", "64", "--data.hflip", "0", "--data.scale", "[1, 1]",
                           "--data.num_workers", "0", "--trainer.max_epochs", "300",
                           "--trainer.check_val_every_n_epoch", "300", "--trainer.accelerator", "cpu",
                           "--trainer.precision", "32-true", "--trainer.enable_progress_bar", "false",
                           "--trainer.default_root_dir", str(run)])
    assert status == 0
    return root, run


@pytest.mark.slow
def test_a_detector_learns_its_scenes_and_evaluate_and_predict_read_it(learned, tmp_path, capsys):
    root, run = learned
    ckpt = run / "checkpoints" / "last.ckpt"
    with open(next(run.glob("logs/*/metrics.csv"))) as f:
        last = [r for r in csv.DictReader(f) if r.get("val/AP50")][-1]
    assert float(last["val/AP50"]) >= 0.9, last  # the scenes it trained on, known
    # evaluate: the checkpoint's scores on the same split are the ones its run logged
    status, err = run_cli(["evaluate", "--checkpoint", str(ckpt), "--data.root", str(root), "--split", "val",
                           "-o", str(tmp_path / "ev")], capsys)
    assert status == 0, err
    metrics = json.loads((tmp_path / "ev/metrics.json").read_text())
    assert metrics["mAP"] == pytest.approx(float(last["val/mAP"]), abs=1e-4)
    assert {"truth.json", "predictions.json", "pr_curve.png", "worst"} <= {p.name for p in (tmp_path / "ev").iterdir()}
    image = root / "val" / "0000.png"
    truth = json.loads((root / "annotations/val.json").read_text())
    expected = sorted(a["category_id"] for a in truth["annotations"] if a["image_id"] == 0)
    status, err = run_cli(["predict", str(image), "--checkpoint", str(ckpt), "-o", str(tmp_path / "out")], capsys)
    assert status == 0, err
    found = json.loads((tmp_path / "out/0000_detections.json").read_text())
    assert sorted(d["category_id"] for d in found) == expected  # the file's own ids (COCO's result format)
    assert sorted(d["index"] for d in found) == [(c - 1) // 3 for c in expected]
    assert (tmp_path / "out/0000_overlay.png").is_file()


RF_DETR = {"out_indices": [1, 2, 4], "windows": 2, "d_model": 64, "queries": 16, "groups": 3, "decoder_layers": 2,
           "ffn_dim": 128, "self_heads": 4, "cross_heads": 4, "c2f_blocks": 1}


@pytest.mark.slow
def test_an_rf_detr_learns_its_scenes_and_exports_as_it_scores(learned, tmp_path, capsys, monkeypatch):
    """RF-DETR's recipe on a tiny windowed ViT learns the scenes YOLOS learns; its ONNX file scores as it does."""
    root, _ = learned
    run = tmp_path / "run"
    status = main(["train", "fit", "-c", "det_rf_detr_base", "--data.root", str(root),
                   "--model.model_name", "vit_tiny_patch16_224", "--model.model_overrides",
                   '{"patch_size": 8, "embed_dim": 64, "depth": 4, "num_heads": 2}',
                   "--model.rf_detr", json.dumps(RF_DETR), "--model.recipe", json.dumps(MEMORISE),
                   "--data.img_size", "64", "--data.hflip", "0", "--data.scale", "[1, 1]", "--data.batch_size", "8",
                   "--data.num_workers", "0", "--trainer.max_epochs", "150",
                   "--trainer.check_val_every_n_epoch", "150", "--trainer.accelerator", "cpu",
                   "--trainer.precision", "32-true", "--trainer.enable_progress_bar", "false",
                   "--trainer.default_root_dir", str(run)])
    assert status == 0
    with open(next(run.glob("logs/*/metrics.csv"))) as f:
        last = [r for r in csv.DictReader(f) if r.get("val/AP50")][-1]
    assert float(last["val/AP50"]) >= 0.9, last  # the scenes it trained on, known
    ckpt = run / "checkpoints" / "last.ckpt"
    status, err = run_cli(["export", str(ckpt), "-o", str(tmp_path / "rf.onnx")], capsys)
    assert status == 0, err
    status, err = run_cli(["evaluate", "--onnx", str(tmp_path / "rf.onnx"), "--data.root", str(root), "--split",
                           "val", "-o", str(tmp_path / "ev")], capsys)
    assert status == 0, err
    assert json.loads((tmp_path / "ev/metrics.json").read_text())["mAP"] == pytest.approx(float(last["val/mAP"]),
                                                                                          abs=1e-4)
    truth = json.loads((root / "annotations/val.json").read_text())
    for source in (["--checkpoint", str(ckpt)], ["--onnx", str(tmp_path / "rf.onnx")]):  # the export records the ids
        out = tmp_path / source[0][2:]
        status, err = run_cli(["predict", str(root / "val/0000.png"), *source, "-o", str(out)], capsys)
        assert status == 0, err
        found = json.loads((out / "0000_detections.json").read_text())
        assert sorted(d["category_id"] for d in found) == sorted(a["category_id"] for a in truth["annotations"]
                                                                 if a["image_id"] == 0)
    with pytest.raises(CheckpointError, match=r"Detector.load_from_checkpoint\(path\).eval\(\).evaluated\(\)"):
        vitkit.load_detector(ckpt)  # the way to a run's model, named
    from vitkit.lit import Detector

    loaded = Detector.load_from_checkpoint(str(ckpt)).eval().evaluated()
    assert type(loaded).__name__ == "RFDETR" and not loaded.training
    line = error_line_of(["export", str(ckpt), "--img-size", "96", "-o", str(tmp_path / "x.onnx")])
    assert "multiples of 16 px already" in line, line
    line = error_line_of(["train", "fit", "-c", "det_rf_detr_base", "--data.root", str(root), "--model.model_name",
                          "vit_tiny_patch16_224", "--model.model_overrides", '{"patch_size": 8, "depth": 4}',
                          "--model.rf_detr", json.dumps({**RF_DETR, "queries": 100}), "--data.img_size", "64",
                          "--trainer.default_root_dir", str(tmp_path / "refused")])
    assert "RF-DETR selects its 100 queries from the map's positions, and --data.img_size 64 gives 64" in line, line
    # int8: its linear layers quantized (the deformable sampling stays float), gated on the held-out AP
    cal = _repeated(root, tmp_path / "cal", 16)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")  # onnxruntime's shape inference writes scratch files where it runs
    status, err = run_cli(["export", str(tmp_path / "rf.onnx"), "--int8", "--calibrate", str(cal),
                           "--calibration-size", "28", "--max-drop", "3", "-o", str(tmp_path / "rf.int8.onnx")],
                          capsys)
    assert status == 0, err
    assert list((tmp_path / "cwd").iterdir()) == []  # none left in the user's working directory
    from vitkit.deploy.onnx_model import OnnxModel

    facts = OnnxModel(str(tmp_path / "rf.int8.onnx")).meta["int8"]
    assert facts["fp32_mAP"] > 0.5 and 100 * (facts["fp32_mAP"] - facts["int8_mAP"]) <= 3.0, facts


def _repeated(root, into, times: int):
    """A COCO val split of ``root``'s val scenes, each listed ``times`` times (image ids of their own, one file)."""
    truth = json.loads((root / "annotations/val.json").read_text())
    images, annotations = [], []
    for _ in range(times):
        for image in truth["images"]:
            images.append({**image, "id": len(images), "file_name": str(root / "val" / image["file_name"])})
            annotations += [{**a, "id": len(annotations) + j, "image_id": images[-1]["id"]}
                            for j, a in enumerate(x for x in truth["annotations"] if x["image_id"] == image["id"])]
    (into / "annotations").mkdir(parents=True)
    (into / "val").mkdir()
    (into / "annotations/val.json").write_text(json.dumps({**truth, "images": images, "annotations": annotations}))
    return into


@pytest.mark.slow
def test_int8_keeps_a_detectors_ap_and_refuses_one_it_breaks(learned, tmp_path, capsys):
    from vitkit.deploy.export import export_onnx
    from vitkit.deploy.onnx_model import OnnxModel
    from vitkit.tasks.detection.inference import export_model

    root, run = learned
    ckpt = run / "checkpoints" / "last.ckpt"
    cal = _repeated(root, tmp_path / "cal", 16)  # 128 images: 28 calibrate, 100 held out
    assert run_cli(["export", str(ckpt), "-o", str(tmp_path / "fp32.onnx")], capsys)[0] == 0
    # a 64-wide model's boxes at 64 px, where int8 kernels differ from CPU to CPU: 3 points of margin
    status, err = run_cli(["export", str(tmp_path / "fp32.onnx"), "--int8", "--calibrate", str(cal),
                           "--calibration-size", "28", "--max-drop", "3", "-o", str(tmp_path / "int8.onnx")], capsys)
    assert status == 0, err
    facts = OnnxModel(str(tmp_path / "int8.onnx")).meta["int8"]
    assert facts["held_out"] == 100 and facts["fp32_mAP"] > 0.8, facts
    assert 100 * (facts["fp32_mAP"] - facts["int8_mAP"]) <= 3.0, facts
    # what the gate scored is what evaluate scores on the held-out images (the last 100 of the seeded order)
    truth = json.loads((cal / "annotations/val.json").read_text())
    kept = np.random.default_rng(0).permutation(len(truth["images"]))[28:].tolist()
    held = {"images": [truth["images"][k] for k in kept], "categories": truth["categories"],
            "annotations": [a for a in truth["annotations"] if a["image_id"] in kept]}
    (tmp_path / "held/annotations").mkdir(parents=True)
    (tmp_path / "held/val").mkdir()
    (tmp_path / "held/annotations/val.json").write_text(json.dumps(held))
    for name in ("fp32", "int8"):
        status, err = run_cli(["evaluate", "--onnx", str(tmp_path / f"{name}.onnx"), "--data.root",
                               str(tmp_path / "held"), "--split", "val", "-o", str(tmp_path / f"ev_{name}")], capsys)
        assert status == 0, err
        scored = json.loads((tmp_path / f"ev_{name}/metrics.json").read_text())
        assert scored["samples"] == 100 and scored["mAP"] == pytest.approx(facts[f"{name}_mAP"], abs=1e-6)
    # an input unit of each fc2 at 1e4 that fc2 multiplies by zero: fp32 is unchanged, int8's ranges are ruined
    net = export_model(str(ckpt), {})
    with torch.no_grad():
        for block in net.backbone.blocks:
            block.mlp.fc1.bias[0] = 1e4
            block.mlp.fc2.weight[:, 0] = 0
    export_onnx(net, tmp_path / "outlier.onnx")
    line = error_line_of(["export", str(tmp_path / "outlier.onnx"), "--int8", "--calibrate", str(cal),
                          "--calibration-size", "28", "-o", str(tmp_path / "bad.onnx")])
    assert "points of AP50:95" in line and "more than --max-drop 1;" in line and "fc2" in line, line
    assert float(line.split("int8 loses ")[1].split()[0]) > 10, line  # far beyond the margin above
    assert not (tmp_path / "bad.onnx").exists()
    # what the gate cannot read ends in one line
    fp32 = str(tmp_path / "fp32.onnx")
    assert error_line_of(["export", fp32, "--int8", "--calibrate", str(root)]) == (
        f"error: --calibrate {root} holds 8 images in its val split; 200 to calibrate (--calibration-size) and 100 "
        "held out for the AP gate need 300; give it at least 116")
    (tmp_path / "cats" / "tabby").mkdir(parents=True)
    assert error_line_of(["export", fp32, "--int8", "--calibrate", str(tmp_path / "cats")]).startswith(
        f"error: --calibrate {tmp_path / 'cats'}: a detector calibrates on a COCO, YOLO or VOC folder")
    import onnx

    proto = onnx.load(fp32)
    next(p for p in proto.metadata_props if p.key == "vitkit.task").value = "segmentation"
    onnx.save(proto, str(tmp_path / "seg.onnx"))
    assert error_line_of(["export", str(tmp_path / "seg.onnx"), "--int8", "--calibrate", str(cal)]) == (
        f"error: {tmp_path / 'seg.onnx'} is a segmentation model, and int8 export scores int8 against fp32 on labelled "
        "images for the tasks that say how (classification, depth, detection); keep this one in fp32")


@pytest.mark.parametrize("args, says", [
    (["--threshold", "2"], "--threshold is a score from 0 to 1, got 2.0"),
    (["--mode", "slide"], "a detector takes --threshold"),
])
@pytest.mark.slow
def test_a_detector_refuses_what_it_does_not_take_in_one_line(learned, args, says):
    root, run = learned
    line = error_line_of(["predict", str(root / "val/0000.png"), "--checkpoint", str(run / "checkpoints/last.ckpt"),
                          *args])
    assert says in line, line


@pytest.mark.slow
def test_a_voc_folder_is_scored_with_the_models_own_classes(learned, tmp_path, capsys):
    """A VOC folder's files name no list of classes: evaluate reads its objects' names as the model's."""
    root, run = learned
    voc = write_voc(tmp_path / "voc", {"val": 8}, seed=5)  # the scenes the detector learned, as VOC
    status, err = run_cli(["evaluate", "--checkpoint", str(run / "checkpoints/last.ckpt"), "--data.root", str(voc),
                           "--split", "val", "-o", str(tmp_path / "ev")], capsys)
    assert status == 0, err
    status, err = run_cli(["evaluate", "--checkpoint", str(run / "checkpoints/last.ckpt"), "--data.root", str(root),
                           "--split", "val", "-o", str(tmp_path / "ev_coco")], capsys)
    assert status == 0, err
    scored = [json.loads((tmp_path / name / "metrics.json").read_text()) for name in ("ev", "ev_coco")]
    assert scored[0]["mAP"] == pytest.approx(scored[1]["mAP"], abs=1e-6) and scored[0]["mAP"] > 0.5


@pytest.mark.slow
def test_a_detector_checkpoint_given_to_a_classifier_is_named_in_one_line(learned, tmp_path):
    _, run = learned
    line = error_line_of(["train", "fit", "-c", "vit_tiny_digits", "--model.checkpoint",
                          str(run / "checkpoints/last.ckpt"), "--trainer.default_root_dir", str(tmp_path)])
    assert line.startswith("error: the checkpoint does not fit vit_tiny_patch16_224 (det_token is in the checkpoint, "
                           "not in the model; strict=True; last.ckpt was written by vitkit.lit.Detector)"), line


def test_folders_a_detector_cannot_read_end_in_one_line(tmp_path):
    from vitkit.errors import UsageError

    write_coco(tmp_path / "coco", {"train": 2, "val": 2})
    with pytest.raises(UsageError, match="holds a coco layout, and --data.layout is yolo"):
        DetectionDataModule(str(tmp_path / "coco"), layout="yolo")
    with pytest.raises(UsageError, match="holds no train split of a layout vitkit reads: COCO"):
        DetectionDataModule(str(tmp_path))
    write_yolo(tmp_path / "yolo", {"train": 2, "val": 2})
    (tmp_path / "yolo/data.yaml").unlink()
    with pytest.raises(UsageError, match="has no data.yaml naming its classes"):
        DetectionDataModule(str(tmp_path / "yolo"))
    (tmp_path / "yolo/data.yaml").write_text("names: 3\n")
    with pytest.raises(UsageError, match="names must be a list of class names or a mapping"):
        DetectionDataModule(str(tmp_path / "yolo"))
    with pytest.raises(UsageError, match="img_size must be one whole number"):
        DetectionDataModule(str(tmp_path / "coco"), img_size=(64, 48))


def test_a_run_starts_from_a_trained_rf_detr_and_its_checkpoint_needs_no_file(tmp_path):
    """--model.detector: every weight of transformers' RF-DETR (5 classes) loaded, new class heads for the data's,
    trained; the run's checkpoint rebuilds the model without the folder."""
    transformers = pytest.importorskip("transformers")
    backbone = dict(model_type="rf_detr_dinov2", hidden_size=64, num_hidden_layers=4, num_attention_heads=2,
                    mlp_ratio=2, patch_size=8, image_size=48, out_features=["stage1", "stage2", "stage4"],
                    num_windows=2)
    cfg = transformers.RfDetrConfig(backbone_config=backbone, d_model=32, decoder_layers=2, decoder_ffn_dim=64,
                                    decoder_self_attention_heads=4, decoder_cross_attention_heads=4, num_queries=8,
                                    group_detr=2, c2f_num_blocks=1, num_labels=5)
    torch.manual_seed(0)
    transformers.RfDetrForObjectDetection(cfg).save_pretrained(tmp_path / "rf")
    trained = vitkit.load_detector(tmp_path / "rf")
    from vitkit.lit import Detector

    start = Detector(detector=str(tmp_path / "rf"), num_classes=3, img_size=64).model.state_dict()
    theirs = trained.state_dict()
    kept = [k for k in theirs if not k.startswith(("class_head.", "enc_class.")) and k != "backbone.pos_embed"]
    assert all(torch.equal(start[k], theirs[k]) for k in kept)  # every weight but the class heads', as trained
    assert start["class_head.weight"].shape == (3, 32) and start["backbone.pos_embed"].shape[1] == 1 + 8 * 8
    root = write_coco(tmp_path / "scenes", {"train": 4, "val": 4}, seed=3)
    run = tmp_path / "run"
    status = main(["train", "fit", "-c", "det_finetune_small_data", "--data.root", str(root),
                   "--model.detector", str(tmp_path / "rf"), "--data.img_size", "64", "--data.batch_size", "4",
                   "--data.num_workers", "0", "--trainer.max_steps", "2", "--trainer.accelerator", "cpu",
                   "--trainer.precision", "32-true", "--trainer.enable_progress_bar", "false",
                   "--trainer.default_root_dir", str(run)])
    assert status == 0
    shutil.rmtree(tmp_path / "rf")  # the checkpoint holds every weight and the settings
    module = Detector.load_from_checkpoint(str(run / "checkpoints" / "last.ckpt"))
    net = module.model
    assert module.hparams.detector is None and net.cfg.queries == 8 and net.cfg.windows == 2
    assert net.class_head.out_features == len(NAMES) != 5  # the data's classes, heads anew
    assert all(net.state_dict()[k].shape == theirs[k].shape for k in kept)
    with pytest.raises(UsageError, match="--model.detector holds the backbone's weights too"):
        Detector(detector=str(run / "x"), checkpoint="b.safetensors", num_classes=2)


def test_category_ids_that_do_not_fit_the_classes_end_in_one_line(tmp_path):
    from vitkit.deploy.onnx_model import read_metadata
    from vitkit.lit import Detector

    with pytest.raises(UsageError, match=r"category_ids names an id for each of the 3 classes, got 2: \[1, 5\]"):
        Detector(model_name="vit_tiny_patch16_224", num_classes=3, img_size=32, category_ids=[1, 5],
                 model_overrides={"depth": 1})
    meta = {"vitkit.labels": json.dumps(["a", "b"]), "vitkit.category_ids": json.dumps([1, 5])}
    assert read_metadata("m.onnx", meta)["category_ids"] == [1, 5]
    for damaged, says in ((json.dumps([1]), "names 1 ids for its 2 labels"), ('{"a": 1}', "a list of ints or strings"),
                          ("[1, true]", "a list of ints or strings"), ("[1,", "is not valid JSON")):
        with pytest.raises(CheckpointError, match=f"m.onnx: its metadata vitkit.category_ids.*{says}"):
            read_metadata("m.onnx", {**meta, "vitkit.category_ids": damaged})
