"""Masks from a Hugging Face dataset (an image and a mask column): the same pairs, transforms and scores as the same
images and masks in a folder; columns told apart by name or named; a bad row named in one line."""

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.commands import error_line_of, run_cli
from vitkit.cli.train import cli_main
from vitkit.lit import HFSegmentationDataModule, SegmentationDataModule

from .segmentation_digits import CLASSES, write_digit_masks
from .test_segmentation_train import TINY_DIGITS_VIT


def as_hf(folder: Path, out: Path, columns: tuple[str, str] = ("image", "annotation")) -> Path:
    """The folder's pairs as a ``save_to_disk`` dataset: splits ``train`` and ``validation``, two Image columns."""
    import datasets

    features = datasets.Features({columns[0]: datasets.Image(), columns[1]: datasets.Image()})
    splits = {}
    for split, name in (("train", "train"), ("val", "validation")):
        images = sorted((folder / "images" / split).glob("*.png"))
        splits[name] = datasets.Dataset.from_dict(
            {columns[0]: [str(p) for p in images], columns[1]: [str(folder / "masks" / split / p.name)
                                                                 for p in images]}, features=features)
    datasets.DatasetDict(splits).save_to_disk(str(out))
    return out


def test_a_hub_dataset_gives_the_pairs_a_folder_gives(tmp_path):
    folder = write_digit_masks(tmp_path / "folder", train=6, val=3, size=48, glyph_size=24)
    hub = as_hf(folder, tmp_path / "hub")
    args = dict(num_classes=len(CLASSES), img_size=32, batch_size=2, num_workers=0, scale=(0.5, 1.5))
    ours, theirs = HFSegmentationDataModule(str(hub), **args), SegmentationDataModule(str(folder), **args)
    assert (ours.image_column, ours.mask_column) == ("image", "annotation")
    for dm in (ours, theirs):
        dm.setup("fit")
    assert len(ours.train_set) == 6 and len(ours.val_set) == 3
    for split in ("train_set", "val_set"):
        for i in range(3):
            random.seed(i)  # the same draws of scale, crop and flip
            x, y = getattr(ours, split)[i]
            random.seed(i)
            x0, y0 = getattr(theirs, split)[i]
            assert torch.equal(x, x0) and torch.equal(y, y0)
    own = ours.eval_view("val", own_size=True)[0]
    assert own[0].shape == (3, 48, 48) and own[1].shape == (48, 48)


def test_trained_and_evaluated_from_a_hub_dataset_as_from_its_folder(tmp_path, capsys, caplog):
    """(And a frozen backbone of random weights, no checkpoint or pretrained tag given, is said in one line.)"""
    import logging

    folder = write_digit_masks(tmp_path / "folder", train=8, val=4, size=32, glyph_size=16)
    hub = as_hf(folder, tmp_path / "hub", ("pixel_values", "label"))
    with caplog.at_level(logging.INFO):
        run = cli_main(["fit", "-c", "seg_linear_probe", "--model.model_name", "vit_tiny_patch16_224",
                        "--model.model_overrides", TINY_DIGITS_VIT, "--data", "vitkit.lit.HFSegmentationDataModule",
                        "--data.name", str(hub), "--data.num_classes", str(len(CLASSES)), "--data.img_size", "32",
                        "--data.batch_size", "4", "--data.num_workers", "0", "--trainer.max_steps", "2",
                        "--trainer.accelerator", "cpu", "--trainer.precision", "32-true",
                        "--trainer.enable_progress_bar", "false",
                        "--trainer.default_root_dir", str(tmp_path / "run")])
    assert "warning: Frozen keeps the backbone's weights, and these are random" in caplog.text
    last = Path(run.trainer.checkpoint_callback.dirpath) / "last.ckpt"
    scores = []
    for data, out in ((["--data", "vitkit.lit.HFSegmentationDataModule", "--data.name", str(hub)], "hub"),
                      (["--data.root", str(folder)], "folder")):
        status, err = run_cli(["evaluate", "--checkpoint", str(last), *data, "-o", str(tmp_path / out)], capsys)
        assert status == 0, err
        scores.append(json.loads((tmp_path / out / "metrics.json").read_text()))
    assert scores[0]["mIoU"] == scores[1]["mIoU"] and scores[0]["samples"] == 4


def test_columns_and_rows_that_are_not_masks_end_in_one_line(tmp_path):
    folder = write_digit_masks(tmp_path / "folder", train=2, val=2, size=32, glyph_size=16)
    base = ["train", "fit", "--model", "vitkit.lit.Segmenter", "--model.model_name", "vit_tiny_patch16_224",
            "--model.model_overrides", TINY_DIGITS_VIT, "--data", "vitkit.lit.HFSegmentationDataModule",
            "--data.num_classes", "4", "--data.img_size", "32", "--data.batch_size", "2", "--data.num_workers", "0",
            "--trainer.max_steps", "1", "--trainer.accelerator", "cpu", "--trainer.default_root_dir",
            str(tmp_path / "run")]
    two = as_hf(folder, tmp_path / "two", ("left", "right"))
    assert error_line_of([*base, "--data.name", str(two)]) == (
        f"error: {two}: which column holds the masks? Its columns are left (Image), right (Image); name it with "
        "--data.mask_column (and the images' with --data.image_column)")
    assert error_line_of([*base, "--data.name", str(two), "--data.mask_column", "middle"]).startswith(
        f"error: {two}: --data.mask_column 'middle' is not a column; its columns are left (Image), right (Image)")
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(folder / "masks" / "val" / "0001.png")  # a colour mask
    rgb = as_hf(folder, tmp_path / "rgb")
    assert error_line_of([*base, "--data.name", str(rgb)]) == (
        f"error: {rgb} (val): the mask of row 1 is a RGB image; a mask holds one class index per pixel (a "
        "single-channel or palette PNG)")
    assert error_line_of([*base, "--data.name", str(rgb), "--data.train_split", "fit"]) == (
        f"error: {rgb} has no split 'fit' (--data.train_split); its splits are train, validation")
    assert error_line_of([*base, "--data.name", str(tmp_path / "absent")]) == (
        f"error: --data.name '{tmp_path / 'absent'}' is neither a folder nor a hub dataset name")
    with pytest.raises(ValueError, match="give --data.num_classes"):
        HFSegmentationDataModule(str(rgb))


def test_a_streamed_dataset_trains_and_scores_as_the_map_style_one(tmp_path, capsys):
    folder = write_digit_masks(tmp_path / "folder", train=8, val=4, size=32, glyph_size=16)
    hub = as_hf(folder, tmp_path / "hub")
    args = dict(num_classes=len(CLASSES), img_size=32, batch_size=2, num_workers=0)
    stream = HFSegmentationDataModule(str(hub), streaming=True, **args)
    rows = HFSegmentationDataModule(str(hub), **args)
    for dm in (stream, rows):
        dm.setup("fit")
    streamed = [(x.numpy().tobytes(), y.numpy().tobytes()) for x, y in stream.val_set]
    assert streamed == [(x.numpy().tobytes(), y.numpy().tobytes()) for x, y in rows.val_set]
    assert sum(1 for _ in stream.train_set) == 8

    base = ["train", "fit", "-c", "seg_finetune_small_data", "--model.model_name", "vit_tiny_patch16_224",
            "--model.model_overrides", TINY_DIGITS_VIT, "--data", "vitkit.lit.HFSegmentationDataModule",
            "--data.name", str(hub), "--data.streaming", "true", "--data.num_classes", str(len(CLASSES)),
            "--data.img_size", "32", "--data.batch_size", "4", "--data.num_workers", "0",
            "--trainer.accelerator", "cpu", "--trainer.precision", "32-true", "--trainer.enable_progress_bar",
            "false", "--trainer.default_root_dir", str(tmp_path / "run")]
    assert error_line_of(base) == (
        "error: the training data is a stream, whose length the LR schedule cannot know: give --trainer.max_steps N, "
        "the optimizer steps of the whole run (the warmup then takes warmup_epochs x N / max_epochs of them)")
    status, err = run_cli([*base, "--trainer.max_steps", "3"], capsys)  # the probe first: it reads the stream
    assert status == 0, err
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    scores = []
    for streaming, out in (("true", "stream"), ("false", "rows")):
        status, err = run_cli(["evaluate", "--checkpoint", str(last), "--data", "vitkit.lit.HFSegmentationDataModule",
                               "--data.name", str(hub), "--data.streaming", streaming, "-o", str(tmp_path / out)],
                              capsys)
        assert status == 0, err
        scores.append(json.loads((tmp_path / out / "metrics.json").read_text()))
    assert scores[0]["mIoU"] == scores[1]["mIoU"] and scores[0]["samples"] == 4
