"""Masks in litdata shards (``vitkit prepare-data`` of a folder of images and masks, streamed by
``StreamingSegmentationDataModule``): the pairs the folder holds, a broken pair left out and listed, a run stopped
mid-epoch that resumes to the weights of one that was not, and the scores of the folder."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.commands import run_cli
from vitkit.cli.train import cli_main
from vitkit.lit import SegmentationDataModule, StreamingImageDataModule, StreamingSegmentationDataModule

from .segmentation_digits import CLASSES, write_digit_masks
from .test_segmentation_train import TINY_DIGITS_VIT

pytestmark = pytest.mark.slow


def _fit(shards: Path, root: Path, steps: int, *more: str):
    return cli_main(["fit", "-c", "seg_linear_probe", "--model.model_name", "vit_tiny_patch16_224",
                     "--model.model_overrides", TINY_DIGITS_VIT, "--model.adaptation", "Full",
                     "--model.recipe.warmup_epochs", "0", "--model.recipe.min_lr", "1e-3",
                      # one LR, whatever the run's length
                     "--data", "vitkit.lit.StreamingSegmentationDataModule", "--data.root", str(shards),
                     "--data.num_classes", str(len(CLASSES)), "--data.img_size", "32", "--data.batch_size", "2",
                     "--data.num_workers", "0", "--trainer.max_steps", str(steps), "--trainer.accelerator", "cpu",
                     "--trainer.precision", "32-true", "--trainer.enable_progress_bar", "false",
                     "--trainer.check_val_every_n_epoch", "5", "--seed_everything", "0",
                     "--trainer.default_root_dir", str(root), *more])


def test_masks_stream_from_shards_as_from_their_folder_and_resume_mid_epoch(tmp_path, capsys):
    folder = write_digit_masks(tmp_path / "folder", train=8, val=4, size=32, glyph_size=16)
    (folder / "images" / "train" / "0008.png").write_bytes(b"not a png")  # left out, and listed
    (folder / "masks" / "train" / "0008.png").write_bytes((folder / "masks" / "train" / "0000.png").read_bytes())
    shards = tmp_path / "shards"
    status, err = run_cli(["prepare-data", str(folder), str(shards), "--workers", "1"], capsys)
    assert status == 0, err
    info = json.loads((shards / "vitkit_dataset.json").read_text())
    assert info["masks"] and info["layout"] == "folder"
    assert info["splits"] == {"train": {"samples": 8, "skipped": 1}, "val": {"samples": 4, "skipped": 0}}
    assert (shards / "train.skipped.tsv").read_text().startswith("images/train/0008.png\t")

    (folder / "images" / "train" / "0008.png").unlink()
    (folder / "masks" / "train" / "0008.png").unlink()
    args = dict(num_classes=len(CLASSES), img_size=32, batch_size=2, num_workers=0)
    ours, theirs = StreamingSegmentationDataModule(str(shards), **args), SegmentationDataModule(str(folder), **args)
    for dm in (ours, theirs):
        dm.setup("fit")
    streamed = sorted((x.numpy().tobytes(), y.numpy().tobytes()) for x, y in ours.val_set)
    assert streamed == sorted((x.numpy().tobytes(), y.numpy().tobytes()) for x, y in theirs.val_set)
    assert len(ours.train_set) == 8 and all(x.shape == (3, 32, 32) and y.shape == (32, 32) for x, y in ours.train_set)

    straight = _fit(shards, tmp_path / "straight", 4)  # one epoch: 4 batches of 2
    _fit(shards, tmp_path / "resumed", 3)
    resumed = _fit(shards, tmp_path / "resumed", 4, "--ckpt_path", "last")
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name

    last = Path(straight.trainer.checkpoint_callback.dirpath) / "last.ckpt"
    scores = []
    for data, out in ((["--data", "vitkit.lit.StreamingSegmentationDataModule", "--data.root", str(shards)], "shards"),
                      (["--data.root", str(folder)], "folder")):
        status, err = run_cli(["evaluate", "--checkpoint", str(last), *data, "-o", str(tmp_path / out)], capsys)
        assert status == 0, err
        scores.append(json.loads((tmp_path / out / "metrics.json").read_text()))
    assert scores[0]["mIoU"] == scores[1]["mIoU"] and scores[0]["samples"] == 4


def test_a_stream_of_masks_and_a_stream_of_labels_are_not_taken_for_each_other(tmp_path, capsys):
    folder = write_digit_masks(tmp_path / "folder", train=2, val=2, size=16, glyph_size=8)
    Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(folder / "masks" / "val" / "0001.png")  # a colour mask
    status, err = run_cli(["prepare-data", str(folder), str(tmp_path / "shards"), "--workers", "1"], capsys)
    assert status == 0, err
    assert "UsageError: the mask is a RGB image" in (tmp_path / "shards" / "val.skipped.tsv").read_text()
    with pytest.raises(ValueError, match="holds images with masks: stream it with --data "
                                         "vitkit.lit.StreamingSegmentationDataModule"):
        StreamingImageDataModule(str(tmp_path / "shards"))
    labels = tmp_path / "labels"
    for split in ("train", "val"):
        (labels / split / "a").mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(labels / split / "a" / "0.png")
    status, err = run_cli(["prepare-data", str(labels), str(tmp_path / "label_shards"), "--workers", "1"], capsys)
    assert status == 0, err
    with pytest.raises(ValueError, match="holds images with class labels, not masks"):
        StreamingSegmentationDataModule(str(tmp_path / "label_shards"), num_classes=2)
