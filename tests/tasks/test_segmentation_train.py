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
    run = cli_main(["fit", "-c", "seg_linear_probe", "--model.adaptation", "Full", "--model.head", "UperNet",
                    "--model.head.channels", "64", "--model.model_name", "vit_tiny_patch16_224",
                    "--model.model_overrides", TINY_DIGITS_VIT, "--model.checkpoint", str(backbone),
                    "--model.recipe.lr",
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
    from vitkit.deploy.onnx_model import OnnxModel

    onnx = OnnxModel(tmp_path / "seg.onnx")  # UperNet's pooling pyramid computes its bins for each size
    assert onnx.meta["task"] == "segmentation" and onnx.labels == CLASSES and onnx.meta["dynamic_size"] is True
    other = torch.nn.functional.interpolate(x, size=(48, 80), mode="bilinear")
    saved.model.set_dynamic_img_size(True)  # the PyTorch model at another size, positions resampled
    with torch.no_grad():
        np.testing.assert_allclose(onnx(x.numpy()), saved(x).numpy(), atol=1e-4)
        np.testing.assert_allclose(onnx(other.numpy()), saved(other).numpy(), atol=1e-4)


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
    assert error_line_of(base) == (f"error: {data}/masks/train/0000.png holds class 12; --data.num_classes is 11 "
                                   "(classes 0 to 10, and 255 where no class counts, --data.ignore_index)")
    assert not (tmp_path / "run").exists()  # refused before the trainer: no folder, no config.yaml
    Image.new("L", (64, 64), color=13).save(data / "masks" / "val" / "0001.png")
    no_count = [a for a in base if a not in ("--data.num_classes", "11")]  # read from the training masks: 13
    assert error_line_of(no_count) == (f"error: {data}/masks/val/0001.png holds class 13; --data.num_classes is 13 "
                                       "(classes 0 to 12, and 255 where no class counts, --data.ignore_index)")
    classifier = ["train", "fit", "-c", "vit_tiny_digits", "--data", "vitkit.lit.ImageFolderDataModule",
                  "--data.root", str(data), "--trainer.default_root_dir", str(tmp_path / "run")]
    assert error_line_of(classifier).startswith(f"error: {data} is a segmentation folder (images/ beside masks/)")


@pytest.mark.slow
def test_seg_finetune_small_data_starts_at_its_probe_and_ends_no_lower(digits_run, tmp_path, capsys, monkeypatch):
    """The small-data recipe with LoRA on 60 images: the linear head fitted on the frozen patch features before the
    first step scores well above a brightness rule; `vitkit evaluate` of `probe.ckpt` gives the logged baseline; the
    run's best is never below it; only the adapters and the head trained. Its ONNX export evaluates as the
    checkpoint does, and the loaded checkpoint's `.model` is the model the run validated and exported, at any
    size."""
    monkeypatch.chdir((tmp_path / "elsewhere").mkdir() or tmp_path / "elsewhere")  # the commands from another folder
    data = write_digit_masks(tmp_path / "data", train=60, val=60)
    backbone = Path(digits_run.trainer.checkpoint_callback.dirpath) / "last.ckpt"
    run = cli_main(["fit", "-c", "seg_finetune_small_data", "--model.model_name", "vit_tiny_patch16_224",
                    "--model.model_overrides", TINY_DIGITS_VIT, "--model.checkpoint", str(backbone),
                    "--model.adaptation", "LoRA", "--model.adaptation.rank", "4", "--data.root", str(data),
                    "--data.num_classes", str(len(CLASSES)),
                    "--data.img_size", "48", "--data.batch_size", "16", "--data.num_workers", "0",
                    "--trainer.max_epochs", "2", "--trainer.accelerator", "cpu", "--trainer.precision", "32-true",
                    "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp_path / "run")])
    probe = run.model.probe_baseline
    assert probe > _brightness_rule(data) + 0.08, (probe, _brightness_rule(data))
    rows = list(csv.DictReader(open(Path(run.trainer.logger.log_dir) / "metrics.csv")))
    assert [float(r["val/probe_baseline"]) for r in rows if r.get("val/probe_baseline")] == [pytest.approx(probe)]
    callback = run.trainer.checkpoint_callback
    assert float(callback.best_model_score) >= probe - 1e-6  # a float32 score: the probe itself where it stands
    folder = Path(callback.dirpath)
    status, err = run_cli(["evaluate", "--checkpoint", str(folder / "probe.ckpt"), "--data.root", str(data), "-o",
                           str(tmp_path / "eval")], capsys)
    assert status == 0, err
    assert json.loads((tmp_path / "eval" / "metrics.json").read_text())["mIoU"] == pytest.approx(probe, abs=1e-6)

    last = float([r["val/mIoU"] for r in rows if r.get("val/mIoU")][-1])
    status, err = run_cli(["evaluate", "--checkpoint", str(folder / "last.ckpt"), "--data.root", str(data), "-o",
                           str(tmp_path / "eval_last")], capsys)  # the run's model: the average it validated
    assert status == 0, err
    assert json.loads((tmp_path / "eval_last" / "metrics.json").read_text())["mIoU"] == pytest.approx(last, abs=1e-6)
    for mode in ("whole", "slide"):  # the 64 px images and masks as they are, the model at 48 px
        stride = ["--stride", "16"] if mode == "slide" else []
        status, err = run_cli(["evaluate", "--checkpoint", str(folder / "last.ckpt"), "--data.root", str(data), "-o",
                               str(tmp_path / mode), "--mode", mode, *stride], capsys)
        assert status == 0, err
        report = json.loads((tmp_path / mode / "metrics.json").read_text())
        counted = np.loadtxt(tmp_path / mode / "confusion_matrix.csv", delimiter=",", skiprows=1, usecols=range(1, 5))
        assert report["mode"] == mode and counted.sum() == 60 * 64 * 64  # every pixel of every mask, at its size
        assert abs(report["mIoU"] - last) < 0.1 and report["mIoU"] > _brightness_rule(data) + 0.05, (mode, report)
    image = sorted((data / "images" / "val").glob("*.png"))[0]
    assert run_cli(["export", str(folder / "last.ckpt"), "-o", str(tmp_path / "seg.onnx")], capsys)[0] == 0
    for mode in (["--mode", "whole"], ["--mode", "slide", "--stride", "16"]):  # 48 px windows over the 64 px image
        for source, out in ((["--checkpoint", str(folder / "last.ckpt")], "torch"),
                            (["--onnx", str(tmp_path / "seg.onnx")], "onnx")):
            status, err = run_cli(["predict", str(image), *source, *mode, "-o", str(tmp_path / mode[1] / out)], capsys)
            assert status == 0, err
        torch_mask, onnx_mask = (np.array(Image.open(tmp_path / mode[1] / out / f"{image.stem}_mask.png"))
                                 for out in ("torch", "onnx"))
        assert torch_mask.shape == (64, 64) and (torch_mask != onnx_mask).mean() < 0.002, mode  # in onnxruntime
    for mode in ("resized", "whole"):  # the export scored as its checkpoint: its size, mean, std and classes
        status, err = run_cli(["evaluate", "--onnx", str(tmp_path / "seg.onnx"), "--data.root", str(data), "--mode",
                               mode, "-o", str(tmp_path / f"onnx_{mode}")], capsys)
        assert status == 0, err
        scored = json.loads((tmp_path / f"onnx_{mode}" / "metrics.json").read_text())["mIoU"]
        expected = last if mode == "resized" else json.loads((tmp_path / "whole" / "metrics.json").read_text())["mIoU"]
        assert scored == pytest.approx(expected, abs=1e-3), mode

    from vitkit.deploy.onnx_model import OnnxModel
    from vitkit.lit import Segmenter

    loaded, onnx = Segmenter.load_from_checkpoint(folder / "last.ckpt").eval(), OnnxModel(tmp_path / "seg.onnx")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for size in ((48, 48), (40, 72)):  # the exported model (the run's average), at its size and another
            x = torch.randn(2, 3, *size, generator=g)
            np.testing.assert_allclose(loaded.model(x).numpy(), onnx(x.numpy()), atol=1e-4)
        x = torch.randn(1, 3, 41, 75, generator=g)  # not whole patches: padded, the logits cut back
        assert loaded.model(x).shape == (1, len(CLASSES), 41, 75)

    start = Segmenter.load_from_checkpoint(folder / "probe.ckpt").state_dict()
    end = Segmenter.load_from_checkpoint(folder / "last.ckpt").state_dict()
    moved = {k for k in end if k.startswith("model.") and not torch.equal(end[k], start[k])}
    assert moved and all(".lora_" in k or k.startswith("model.decode_head.") for k in moved), sorted(moved)
    assert any(".lora_" in k for k in moved)


def test_the_overlay_tints_each_class_and_leaves_the_background_as_it_is(tmp_path):
    """``predict``'s overlay: class 0 (the palette's black, VOC's background) keeps the image's pixels, every other
    class is its palette colour blended in at half strength; the mask file holds the indices."""
    from vitkit.masks import palette, save_mask

    image = Image.fromarray(np.full((4, 6, 3), 200, np.uint8))
    mask = np.zeros((4, 6), np.int64)
    mask[2:] = 1
    mask_file, overlay_file = save_mask(mask, image, tmp_path / "photo", 3)
    overlay = np.asarray(Image.open(overlay_file), np.float32)
    assert (overlay[:2] == 200).all()
    np.testing.assert_allclose(overlay[2:], np.broadcast_to(0.5 * 200 + 0.5 * palette(3)[1], (2, 6, 3)), atol=1)
    assert (np.array(Image.open(mask_file)) == mask).all()


def test_sliding_windows_of_a_pointwise_model_give_its_logits_at_full_size():
    """A 1x1 conv gives each pixel the same logits in every window: sliding (mmsegmentation's grid, windows padded
    past a short side) then equals the model on the whole image, whatever the sizes and strides."""
    from vitkit.evaluation.segmentation import segment_logits, windows
    from vitkit.masks import slide_logits

    assert windows(70, 32, 20) == [(0, 32), (20, 52), (38, 70)] and windows(20, 32, 20) == [(0, 20)]
    model = torch.nn.Conv2d(3, 5, 1)
    g = torch.Generator().manual_seed(0)
    for shape, stride in (((70, 45), (20, 13)), ((20, 50), None), ((32, 32), (32, 32)), ((33, 97), (1, 31))):
        x = torch.randn(2, 3, *shape, generator=g)
        with torch.no_grad():
            torch.testing.assert_close(segment_logits(model, x, (32, 32), "slide", stride), model(x))
            run = lambda a: model(torch.from_numpy(a)).numpy()  # noqa: E731 - the ONNX path's numpy windows
            np.testing.assert_allclose(slide_logits(run, x.numpy(), (32, 32), stride), model(x).numpy(), atol=1e-5)
    with pytest.raises(ValueError, match="stride must be from 1 to the model's size 32x32, got 40x8"):
        segment_logits(model, x, (32, 32), "slide", (40, 8))


def test_the_upernet_swin_recipe_runs_with_its_poly_schedule(tmp_path):
    """`upernet_swin` on a tiny Swin: two steps with the auxiliary head's loss, the LR decaying by poly."""
    data = write_digit_masks(tmp_path / "data", train=8, val=4)
    run = cli_main(["fit", "-c", "upernet_swin", "--model.model_overrides", '{"embed_dim": 16, "depths": [1, 1, 1, 1], '
                    '"num_heads": [1, 1, 1, 1], "window_size": 2}', "--model.head.channels", "16",
                    "--data.root", str(data), "--data.num_classes", str(len(CLASSES)), "--data.img_size", "64",
                    "--data.batch_size", "4", "--data.num_workers", "0", "--trainer.max_steps", "2",
                    "--trainer.limit_val_batches", "1", "--trainer.accelerator", "cpu",
                    "--trainer.precision", "32-true", "--trainer.enable_progress_bar", "false",
                    "--trainer.default_root_dir", str(tmp_path / "run")])
    scheduler = run.trainer.lr_scheduler_configs[0].scheduler
    assert run.trainer.global_step == 2 and run.model.model.auxiliary_head is not None
    assert scheduler.schedule.decay == "poly" and scheduler.schedule.total == 2


def test_predicts_mode_and_stride_refused_in_one_line(tmp_path):
    image = tmp_path / "a.png"
    Image.new("RGB", (8, 8)).save(image)
    assert error_line_of(["predict", str(image), "--model", "vit_tiny_patch16_224", "--stride", "3"]) == \
        "error: --stride is the step of --mode slide's windows; give --mode slide with it"
    assert error_line_of(["predict", str(image), "--model", "vit_tiny_patch16_224", "--mode", "slide", "--stride",
                          "3", "0"]) == "error: --stride takes H W or one number, each 1 or more, got 3 0"
    assert error_line_of(["predict", str(image), "--model", "vit_tiny_patch16_224", "--mode", "slide"]) == \
        "error: --mode slide and --stride apply to a segmenter (a vitkit.lit.Segmenter checkpoint, or its ONNX export)"


def test_a_resumed_segmentation_run_ends_where_the_uninterrupted_one_does(tmp_path):
    """Random scales, crops and flips, Dice, EMA and the poly schedule: 2 epochs, a stop, 2 more from `last.ckpt`
    give the weights (BatchNorm statistics and the average included) and the LR of 4 epochs in one go."""
    data = write_digit_masks(tmp_path / "data", train=16, val=4, size=32, glyph_size=16)

    def fit(root: Path, *extra: str):
        return cli_main(["fit", "-c", "seg_linear_probe", "--model.model_name", "vit_tiny_patch16_224",
                         "--model.model_overrides", TINY_DIGITS_VIT, "--model.head", "UperNet", "--model.head.channels",
                         "16", "--model.adaptation", "Full", "--model.loss.dice_weight", "0.5",
                         "--model.recipe.ema_decay", "0.9", "--model.recipe.schedule", "poly", "--data.root", str(data),
                         "--data.num_classes", str(len(CLASSES)), "--data.img_size", "32", "--data.batch_size", "4",
                         "--data.num_workers", "0", "--trainer.max_epochs", "4", "--trainer.accelerator", "cpu",
                         "--trainer.precision", "32-true", "--trainer.enable_progress_bar", "false",
                         "--trainer.logger", "false", "--trainer.default_root_dir", str(root), *extra])

    full = fit(tmp_path / "full")
    fit(tmp_path / "resumed", "--trainer.callbacks+=tests.tasks.ddp_probe.StopAfterEpoch", "--trainer.callbacks.epoch",
        "2")
    resumed = fit(tmp_path / "resumed", "--ckpt_path", "last")
    assert resumed.trainer.global_step == full.trainer.global_step == 16
    lr = lambda cli: cli.trainer.optimizers[0].param_groups[0]["lr"]  # noqa: E731
    assert lr(resumed) == pytest.approx(lr(full))
    ours, theirs = resumed.model.state_dict(), full.model.state_dict()
    assert sorted(ours) == sorted(theirs) and any(k.endswith("running_mean") for k in ours)
    for k in ours:
        torch.testing.assert_close(ours[k], theirs[k], atol=1e-5, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


def test_the_classes_read_from_the_masks_are_the_runs_in_its_logs_and_checkpoint(tmp_path):
    """Without --data.num_classes the folder's training masks give the classes; the recipe's logger records them as
    the model has them (Lightning compares the data's and the model's hyper-parameters), and so does the
    checkpoint."""
    data = write_digit_masks(tmp_path / "data", train=4, val=2, size=32, glyph_size=16)
    cli_main(["fit", "-c", "seg_linear_probe", "--model.model_name", "vit_tiny_patch16_224", "--model.model_overrides",
              TINY_DIGITS_VIT, "--data.root", str(data), "--data.img_size", "32", "--data.batch_size", "2",
              "--trainer.max_steps", "1", "--trainer.limit_val_batches", "1", "--trainer.accelerator", "cpu",
              "--trainer.devices", "1", "--trainer.precision", "32-true", "--trainer.default_root_dir",
              str(tmp_path / "run")])
    ckpt = torch.load(tmp_path / "run/checkpoints/last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["hyper_parameters"]["num_classes"] == ckpt["datamodule_hyper_parameters"]["num_classes"] == len(CLASSES)
