"""Segmentation trained through the command: real handwritten digits placed in larger images, a mask of the
digit's class on its strokes (``segmentation_digits.py``); the scores the run logs are those a confusion matrix
counted by numpy gives; bad folders end in one line."""

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.commands import error_line_of, run_cli
from vitkit.cli.train import cli_main
from vitkit.evaluation.segmentation import scores

from .segmentation_digits import CLASSES, write_digit_masks

TINY_DIGITS_VIT = '{"patch_size": 4, "embed_dim": 96, "num_heads": 3, "depth": 2}'  # the demo's, as digits_run


def numpy_scores(pred: np.ndarray, label: np.ndarray, classes: int, ignore: int) -> tuple[np.ndarray, float, float]:
    """IoU per class (NaN where a class is in neither), mIoU and pixel accuracy, counted as mmsegmentation does."""
    keep = label != ignore
    count = np.bincount(label[keep] * classes + pred[keep], minlength=classes ** 2).reshape(classes, classes)
    hits, union = np.diag(count), count.sum(0) + count.sum(1) - np.diag(count)
    with np.errstate(invalid="ignore", divide="ignore"):
        iou = np.where(union > 0, hits / union, np.nan)
    return iou, float(np.nanmean(iou)), float(hits.sum() / count.sum())


def test_iou_from_the_confusion_matrix_is_numpys_count():
    from torchmetrics.classification import MulticlassConfusionMatrix

    g = torch.Generator().manual_seed(0)
    label = torch.randint(0, 5, (4, 16, 16), generator=g)
    label[0, :4] = 255
    pred = torch.where(torch.rand(label.shape, generator=g) < 0.6, label.clamp(max=4), torch.randint(0, 5, label.shape,
                                                                                                       generator=g))
    pred[label == 3] = 1  # class 3: labelled, never predicted (IoU 0); class 4 predicted nowhere it is not labelled
    matrix = MulticlassConfusionMatrix(6, ignore_index=255)
    matrix.update(pred, label)
    iou, miou, acc = scores(matrix.compute().numpy())
    expected_iou, expected_miou, expected_acc = numpy_scores(pred.numpy().ravel(), label.numpy().ravel(), 6, 255)
    np.testing.assert_allclose(iou, expected_iou, rtol=1e-6)  # class 5: in neither, NaN in both
    assert np.isnan(iou[5]) and miou == pytest.approx(expected_miou) and acc == pytest.approx(expected_acc)


def _brightness_rule(data: Path) -> float:
    """The best mIoU of a per-pixel rule that knows no digit: the training masks' most common digit wherever the
    image is brighter than a threshold, the background elsewhere (the best of a few thresholds)."""
    def stack(kind: str, split: str) -> np.ndarray:
        return np.stack([np.array(Image.open(p).convert("L") if kind == "images" else Image.open(p))
                         for p in sorted((data / kind / split).glob("*.png"))])

    train, images, masks = stack("masks", "train"), stack("images", "val"), stack("masks", "val")
    common = np.bincount(train[train > 0]).argmax()
    return max(numpy_scores(np.where(images > t, common, 0).ravel(), masks.ravel(), len(CLASSES), 255)[1]
               for t in (20, 40, 80, 120))


@pytest.mark.slow
def test_upernet_learns_digit_masks_on_the_digits_backbone(digits_run, tmp_path, capsys):
    """From the demo's trained ViT, six epochs of UperNet on 300 images of three digits: mIoU well above its first
    validation's and a per-pixel brightness rule's; the logged mIoU is numpy's count over what the model
    predicts, and `vitkit predict`, `evaluate` and `export` give the same model's masks and scores."""
    data = write_digit_masks(tmp_path / "data")
    backbone = Path(digits_run.trainer.checkpoint_callback.dirpath) / "last.ckpt"
    run = cli_main(["fit", "-c", "seg_linear_probe", "--model.freeze_backbone", "false", "--model.head", "upernet",
                    "--model.head_args", '{"channels": 64}', "--model.model_name", "vit_tiny_patch16_224",
                    "--model.model_overrides", TINY_DIGITS_VIT, "--model.checkpoint", str(backbone), "--model.lr",
                    "2e-3", "--data.root", str(data), "--data.num_classes", str(len(CLASSES)), "--data.classes",
                    str(CLASSES),
                    "--data.img_size", "64", "--data.batch_size", "16", "--data.num_workers", "0", "--data.scale",
                    "[0.8, 1.25]", "--trainer.max_epochs", "6", "--trainer.accelerator", "cpu", "--trainer.devices",
                    "1", "--trainer.precision", "32-true", "--trainer.enable_progress_bar", "false",
                    "--trainer.default_root_dir", str(tmp_path / "run")])
    rows = [r for r in csv.DictReader(open(Path(run.trainer.logger.log_dir) / "metrics.csv")) if r.get("val/mIoU")]
    first, logged = float(rows[0]["val/mIoU"]), float(rows[-1]["val/mIoU"])
    assert logged > max(first, _brightness_rule(data)) + 0.08, (first, logged, _brightness_rule(data))

    model = run.model.eval()
    dm = run.datamodule
    preds, labels = [], []
    with torch.no_grad():
        for x, y in dm.val_dataloader():
            x, y = dm.on_after_batch_transfer((x, y), 0)
            preds.append(model(x).argmax(1).numpy().ravel())
            labels.append(y.numpy().ravel())
    _, miou, acc = numpy_scores(np.concatenate(preds), np.concatenate(labels), len(CLASSES), 255)
    assert miou == pytest.approx(logged, abs=1e-6)
    assert acc == pytest.approx(float(rows[-1]["val/pixel_acc"]), abs=1e-6)
    assert run.model.hparams.class_names == CLASSES
    from vitkit.lit import Segmenter

    saved = Segmenter.load_from_checkpoint(Path(run.trainer.checkpoint_callback.dirpath) / "last.ckpt").eval()
    with torch.no_grad():  # the file alone rebuilds the model: no backbone file, no download
        torch.testing.assert_close(saved(x), model(x))

    image = sorted((data / "images" / "val").glob("*.png"))[0]
    status, err = run_cli(["predict", str(image), "--checkpoint", str(Path(run.trainer.checkpoint_callback.dirpath)
                                                                        / "last.ckpt"), "-o", str(tmp_path / "out")],
                          capsys)
    assert status == 0, err
    written = np.array(Image.open(tmp_path / "out" / f"{image.stem}_mask.png"))
    assert (written == preds[0][: 64 * 64].reshape(64, 64)).all()  # the first val image's argmax, as evaluated
    assert (tmp_path / "out" / f"{image.stem}_overlay.png").is_file()

    status, err = run_cli(["evaluate", "--checkpoint", str(Path(run.trainer.checkpoint_callback.dirpath) / "last.ckpt"),
                           "--data.root", str(data), "-o", str(tmp_path / "eval")], capsys)
    assert status == 0, err
    report = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert report["mIoU"] == pytest.approx(logged, abs=1e-6) and report["split"] == "val"
    assert list(report["per_class_iou"]) == CLASSES and len(list((tmp_path / "eval" / "worst").glob("*.png"))) == 8

    status, err = run_cli(["export", str(Path(run.trainer.checkpoint_callback.dirpath) / "last.ckpt"), "-o",
                           str(tmp_path / "seg.onnx")], capsys)  # checked in onnxruntime at 3 shapes, or refused
    assert status == 0, err
    from vitkit.tools.onnx_model import OnnxModel

    onnx = OnnxModel(tmp_path / "seg.onnx")  # UperNet's pooling pyramid: a fixed size (a linear head: any size)
    assert onnx.meta["task"] == "segmentation" and onnx.labels == CLASSES and onnx.meta["dynamic_size"] is False
    with torch.no_grad():
        np.testing.assert_allclose(onnx(x.numpy()), saved(x).numpy(), atol=1e-4)


def test_folders_that_are_not_segmentation_data_end_in_one_line(tmp_path):
    data = write_digit_masks(tmp_path / "data", train=2, val=2)
    base = ["train", "fit", "--model", "vitkit.lit.Segmenter", "--model.model_name", "vit_tiny_patch16_224",
            "--model.model_overrides", TINY_DIGITS_VIT, "--data", "vitkit.lit.SegmentationDataModule",
            "--data.root", str(data), "--data.num_classes", "11", "--data.img_size", "64", "--data.batch_size", "2",
            "--data.num_workers", "0", "--trainer.max_steps", "1", "--trainer.accelerator", "cpu",
            "--trainer.default_root_dir", str(tmp_path / "run")]
    (data / "masks" / "val" / "0001.png").unlink()
    assert error_line_of(base) == f"error: {data}/images/val/0001.png has no mask: expected {data}/masks/val/0001.png"
    Image.new("RGB", (64, 64)).save(data / "masks" / "val" / "0001.png")
    assert "is a RGB image; a mask holds one class index per pixel" in error_line_of(base)
    Image.new("L", (64, 32)).save(data / "masks" / "val" / "0001.png")
    assert error_line_of(base).endswith("0001.png is 64x32, its image " + str(data / "images" / "val" / "0001.png")
                                        + " 64x64: a mask has its image's size")
    Image.new("L", (64, 64), color=12).save(data / "masks" / "val" / "0001.png")
    Image.new("L", (64, 64), color=12).save(data / "masks" / "train" / "0000.png")
    Image.new("L", (64, 64), color=12).save(data / "masks" / "train" / "0001.png")
    assert "a mask holds class 12; SegmentationDataModule" in error_line_of(base)
    assert "has 11 classes (0 to 10) and ignore_index 255" in error_line_of(base)
