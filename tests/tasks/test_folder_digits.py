"""What a new user meets moving a recipe and a backbone file to their own folder, through the command and from
another folder: a recipe's data settings carry over to a folder module (the others said in one line), whose
augmentation suits the image size, so the digits recipe learns on a folder of 28 px digits as it does on the
digits module; a backbone file of any preset is matched to its preset; a recipe's path from another folder is the
recipe; evaluate scores what training validated; a run ends with its best score."""

import csv
import re
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from PIL import Image
from safetensors.torch import save_file

from tests.commands import one_error_line, run_cli
from vitkit.data.modules.images import ImageFolderDataModule
from vitkit.data.modules.loaders import MAX_WORKERS

pytestmark = pytest.mark.slow

CPU = ["--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.precision", "32-true"]


def write_digits(root: Path, size: int = 28, per_class: int | None = None, classes=range(10), seed: int = 0) -> Path:
    """scikit-learn's 1,797 digits (those of ``classes``) as an ImageNet-style folder of ``size`` px PNGs: every
    fifth of a class in val/, the rest (``per_class`` of it, if given) in train/, in an order drawn by ``seed``."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    order = np.random.default_rng(seed).permutation(len(digits.target))
    seen: dict[int, int] = {}
    for i in order:
        label = int(digits.target[i])
        if label not in classes:
            continue
        n = seen[label] = seen.get(label, 0) + 1
        split = "val" if n % 5 == 1 else "train"
        if split == "train" and per_class is not None and n - 1 - (n - 1) // 5 > per_class:
            continue
        pixels = (digits.images[i] * 255 / 16).astype(np.uint8)
        out = root / split / str(label)
        out.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).resize((size, size), Image.BILINEAR).convert("RGB").save(out / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def digits_folder(tmp_path_factory) -> Path:
    return write_digits(tmp_path_factory.mktemp("digits28"))


def test_the_digits_recipe_learns_on_a_folder_of_28px_digits_as_on_the_digits_module(digits_folder, tmp_path,
                                                                                      capfd, said, monkeypatch):
    """``-c vit_tiny_digits --data vitkit.lit.ImageFolderDataModule``: the folder module keeps the recipe's batch and
    workers, says which digits settings it has no field for, and augments 28 px images by a mild crop alone (no 8 %
    crops, flips or RandAugment, under which every recipe stayed near chance). At 8 epochs (a fifth of the
    recipe's) best val top-1 over seeds 0-2 is 0.734 / 0.808 / 0.907."""
    monkeypatch.chdir(tmp_path)  # a stranger's folder, not the source tree
    root = tmp_path / "run"
    status, err = run_cli(["train", "fit", "-c", "vit_tiny_digits", "--data", "vitkit.lit.ImageFolderDataModule",
                           "--data.root", str(digits_folder), "--data.img_size", "28", "--trainer.max_epochs", "8",
                           "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(root)], capfd)
    assert status == 0, err
    said = said.messages
    assert "data: vitkit.lit.ImageFolderDataModule has no field for the config's vitkit.lit.DigitsDataModule " \
           "setting(s) val_fraction, seed, augment; they do not apply" in said, said
    best = re.fullmatch(r"best val/top1 (\d\.\d+) at epoch (\d+): (\S+\.ckpt)", said[-1])  # the run's last line
    assert best and Path(best.group(3)).is_file(), said
    rows = list(csv.DictReader(open(next(root.glob("logs/version_0/metrics.csv")))))
    top1 = [float(r["val/top1"]) for r in rows if r.get("val/top1")]
    assert float(best.group(1)) == pytest.approx(max(top1), abs=1e-4) and top1.index(max(top1)) == int(best.group(2))
    assert max(top1) >= 0.6, top1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nothing written outside the run's root


def test_a_folder_module_augments_by_image_size_and_takes_the_machines_workers(digits_folder):
    small = ImageFolderDataModule(str(digits_folder), img_size=28)
    assert small.augmentation() == {"auto_augment": None, "re_prob": 0.0, "scale": (0.8, 1.0), "hflip": 0.0,
                                    "color_jitter": None}
    names = [type(t).__name__ for t in small.train_transform().transforms]
    assert "RandomHorizontalFlip" not in names and "RandAugment" not in names and "RandomErasing" not in names
    big = ImageFolderDataModule(str(digits_folder), img_size=224, hflip=0.0)
    assert big.augmentation()["auto_augment"] == "rand-m9-mstd0.5-inc1" and big.augmentation()["hflip"] == 0.0
    from lightning.fabric.utilities.data import suggested_max_num_workers

    assert small.workers() == min(MAX_WORKERS, suggested_max_num_workers(1))
    assert ImageFolderDataModule(str(digits_folder), num_workers=0).workers() == 0


@pytest.fixture(scope="module")
def dinov2_backbone(tmp_path_factory) -> Path:
    """A bare state dict of timm's DINOv2-architecture ViT-S/14 (random weights), as a PyPI wheel ships one."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("backbone") / "backbone.safetensors"
    save_file(timm.create_model("vit_small_patch14_dinov2", num_classes=0, img_size=28).state_dict(), path)
    return path


def test_the_probe_recipe_takes_a_backbone_of_another_preset_by_its_shapes(dinov2_backbone, digits_folder, tmp_path,
                                                                           capfd, said, monkeypatch):
    """README's probe command with a ViT-S/14 file, given by the source tree's recipe path from another folder:
    the recipe's default preset (ViT-B/16) gives way to the one the file's shapes fit, and the run says so."""
    monkeypatch.chdir(tmp_path)
    status, err = run_cli(["train", "fit", "--config", "configs/linear_probe.yaml", "--model.checkpoint",
                           str(dinov2_backbone), "--data.root", str(digits_folder), "--data.img_size", "28",
                           "--data.batch_size", "32", "--trainer.fast_dev_run", "2", *CPU], capfd)
    assert status == 0, err
    assert "note: configs/linear_probe.yaml is not a file here; using the recipe linear_probe" in err, err
    said = "\n".join(said.messages)
    assert "model: vit_small_patch14_dinov2 (matched to its shapes), the preset of" in said, said
    assert "in place of the recipe's default vit_base_patch16_224" in said, said


def test_a_named_preset_the_backbone_does_not_fit_names_the_first_shape_and_the_presets_that_fit(
        dinov2_backbone, digits_folder, tmp_path, capfd, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = one_error_line(*run_cli(["train", "fit", "-c", "linear_probe", "--model.model_name", "vit_base_patch16_224",
                                    "--model.checkpoint", str(dinov2_backbone), "--data.root", str(digits_folder),
                                    "--trainer.fast_dev_run", "1", *CPU], capfd))
    assert "does not fit the model vit_base_patch16_224 (patch_embed.proj.weight: checkpoint (384, 3, 14, 14) vs " \
           "model (768, 3, 16, 16)); presets its shapes fit: vit_small_patch14_dinov2" in line, line
    assert not list(tmp_path.iterdir())


def test_evaluate_scores_a_bare_backbone_by_its_shapes_or_by_the_preset_named(dinov2_backbone, digits_folder,
                                                                              tmp_path, capsys):
    for extra in ([], ["--model", "vit_small_patch14_dinov2"]):
        out = tmp_path / f"eval{len(extra)}"
        status, err = run_cli(["evaluate", "--checkpoint", str(dinov2_backbone), *extra, "--data.root",
                               str(digits_folder), "--data.img_size", "28", "--knn", "-o", str(out)], capsys)
        assert status == 0, err
        assert (out / "metrics.json").exists()
    line = one_error_line(*run_cli(["evaluate", "--checkpoint", str(dinov2_backbone), "--model",
                                    "vit_base_patch16_224", "--data.root", str(digits_folder), "--knn", "-o",
                                    str(tmp_path / "bad")], capsys))
    assert "patch_embed.proj.weight" in line and "vit_small_patch14_dinov2" in line, line


def _best_top1(root: Path) -> float:
    rows = list(csv.DictReader(open(next(root.glob("logs/version_0/metrics.csv")))))
    return max(float(r["val/top1"]) for r in rows if r.get("val/top1"))


def test_mae_on_a_folder_of_unlabeled_digits_beats_random_weights_with_20_labels_per_class(digits_folder, tmp_path,
                                                                                           capfd, monkeypatch):
    """MAE's digits recipe on the 1,437 training digits of the 28 px folder, read without labels (20 of its 30
    epochs), then the digits recipe on 20 labelled digits per class (30 epochs, validated every 5), from that
    encoder and from random weights. Best val top-1 here: 0.865 from the encoder, 0.415 from random weights; the
    same protocol in a script, over seeds 0 / 1: 0.813 / 0.734 against 0.420 / 0.549."""
    monkeypatch.chdir(tmp_path)
    status, err = run_cli(["train", "fit", "-c", "mae_vit_tiny_digits", "--data", "vitkit.lit.UnlabeledImageDataModule",
                           "--data.root", str(digits_folder / "train"), "--data.img_size", "28",
                           "--trainer.max_epochs", "20", "--trainer.limit_val_batches", "1", *CPU,
                           "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", "mae"], capfd)
    assert status == 0, err
    few = write_digits(tmp_path / "few", per_class=20)
    best = {}
    for name, source in (("encoder", ["--model.checkpoint", "mae/checkpoints/last.ckpt"]), ("random", [])):
        status, err = run_cli(["train", "fit", "-c", "vit_tiny_digits", "--data", "vitkit.lit.ImageFolderDataModule",
                               "--data.root", str(few), "--data.img_size", "28", "--trainer.max_epochs", "30",
                               "--trainer.check_val_every_n_epoch", "5", *CPU, "--trainer.enable_progress_bar",
                               "false", "--trainer.default_root_dir", name, *source], capfd)
        assert status == 0, err
        best[name] = _best_top1(tmp_path / name)
    print(best)
    assert best["encoder"] >= 0.6 and best["encoder"] >= best["random"] + 0.1, best
