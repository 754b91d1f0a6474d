"""Fine-tuning from a backbone saved without a head (timm's ``num_classes=0``), as self-supervised and image-text
backbones ship: the head is new, the backbone loads strictly, and the run beats the same run from random weights.
Errors about such input reach the training command's user as one line."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from tests import forkserver
from vitkit.cli.train import cli_main

from ..commands import error_line_of
from .conftest import ROOT, write_few_shot_digits

# What each family's digits recipe trains, and the preset and overrides timm builds the same model from.
FAMILIES = {
    "vit": ("configs/vit_tiny_digits.yaml", "vit_tiny_patch16_224",
            {"patch_size": 4, "embed_dim": 96, "num_heads": 3, "depth": 2}),
    "swin": ("configs/swin_tiny_digits.yaml", "swin_tiny_patch4_window7_224",
             {"patch_size": 2, "embed_dim": 48, "depths": (2, 2, 2), "num_heads": (2, 4, 8), "window_size": 4}),
}


def _cpu(root: Path, seed: int = 0) -> list[str]:
    return ["--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.precision", "32-true",
            "--trainer.default_root_dir", str(root), "--trainer.logger", "false", "--trainer.enable_progress_bar",
            "false", "--trainer.enable_checkpointing", "false", "--trainer.callbacks", "[]",
            "--seed_everything", str(seed)]


def pretrain_backbone(family: str, out: Path, seed: int = 0) -> Path:
    """Train the family's digits recipe for 6 epochs and save its backbone as timm does (:func:`backbone_file`)."""
    config, _, overrides = FAMILIES[family]
    cli = cli_main(["fit", "--config", str(ROOT / config), *_cpu(out / "pretrain", seed), "--trainer.max_epochs", "6",
                    "--trainer.check_val_every_n_epoch", "6", "--model.recipe.warmup_epochs", "1",
                    "--model.model_overrides", str(overrides).replace("'", '"').replace("(", "[").replace(")", "]")])
    return backbone_file(family, cli.model.model, out)


def backbone_file(family: str, trained: torch.nn.Module, out: Path) -> Path:
    """Move a trained classifier's weights into timm's model of the same architecture built with
    ``num_classes=0``, and save what timm holds: a backbone file without a head."""
    _, preset, overrides = FAMILIES[family]
    timm_model = timm.create_model(preset, num_classes=0, img_size=32, **overrides)
    timm_model.load_state_dict({k: v for k, v in trained.state_dict().items() if not k.startswith("head.")},
                               strict=True)
    path = out / f"{family}_backbone.safetensors"
    save_file({k: v.contiguous() for k, v in timm_model.state_dict().items()}, path)
    return path


def fine_tune(family: str, data: Path, root: Path, checkpoint: Path | None, freeze: bool, seed: int = 0):
    config, preset, overrides = FAMILIES[family]
    source = ["--model.checkpoint", str(checkpoint)] if checkpoint else []
    return cli_main(["fit", "--config", str(ROOT / "configs/vit_base_finetune.yaml"), *_cpu(root, seed),
                     "--model.model_name", preset, "--model.pretrained", "false", *source,
                     "--model.model_overrides", str(overrides).replace("'", '"').replace("(", "[").replace(")", "]"),
                     "--model.adaptation", "Frozen" if freeze else "Full",
                     *(["--model.recipe.layer_decay", "null", "--model.recipe.lr",
                        "1e-2"] if freeze else  # a linear probe
                       ["--model.recipe.layer_decay", "0.65", "--model.recipe.lr", "2e-3"]), "--model.recipe.lr_batch",
                       "null",
                     "--model.recipe.warmup_epochs", "0",
                     "--model.labels.mixup", "0", "--model.labels.cutmix", "0", "--trainer.max_epochs", "10",
                     "--trainer.check_val_every_n_epoch", "10",  # only the last epoch's top-1 is read
                     "--data.root", str(data), "--data.img_size", "40", "--data.batch_size", "3",
                     "--data.num_workers", "0", "--data.auto_augment", "null", "--data.re_prob", "0",
                     "--data.scale", "[0.8, 1.0]", "--data.hflip", "0"])


def fine_tune_start(family: str, path: Path) -> dict[str, torch.Tensor]:
    """The weights a fine-tuning run starts from: the file's backbone, the head at the seed's initialisation."""
    import vitkit

    _, preset, overrides = FAMILIES[family]
    torch.manual_seed(0)
    return vitkit.create_model(preset, checkpoint=path, num_classes=3, img_size=40, **overrides).state_dict()


@pytest.fixture(scope="module")
def backbones(tmp_path_factory, digits_run) -> tuple[dict[str, Path], Path]:
    """ViT's backbone is the digits model the session trains already (the demo's recipe, whose architecture is
    FAMILIES["vit"]'s); Swin's is its recipe's 6 epochs."""
    out = tmp_path_factory.mktemp("headless")
    return ({"vit": backbone_file("vit", digits_run.model.model, out), "swin": pretrain_backbone("swin", out)},
            write_few_shot_digits(out / "few_shot"))


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("freeze", [True, False], ids=["linear_probe", "full"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_fine_tuning_from_a_headless_backbone_file_beats_random_weights(family, freeze, backbones, tmp_path):
    """At 40 px from a 32 px backbone (ViT's positions resampled; Swin's maps padded to whole windows), 8 images
    per class, 120 validation images (validated after the last epoch only). Val top-1 from the backbone / from
    random weights / gap, over fine-tuning seeds 0-4 from the session's digits model (20 epochs) for ViT: probe
    0.992-1.000 / 0.242-0.350 / 0.650-0.758, whole 0.967-1.000 / 0.142-0.333 / 0.650-0.825; over seeds 0-4 of
    backbone (6 epochs) and fine-tuning for Swin: probe 0.842-0.942 / 0.367-0.475 / 0.433-0.550, whole
    0.667-0.817 / 0.283-0.508 / 0.283-0.392. The bounds sit well outside that spread."""
    files, data = backbones
    cli = fine_tune(family, data, tmp_path / "tuned", files[family], freeze)
    report = cli.model.model.load_report
    assert report.ok and "head: new (not in the checkpoint)" in report.adapted, report
    assert report.new_head == (["head.fc.bias", "head.fc.weight"] if family == "swin" else ["head.bias", "head.weight"])
    state = cli.model.model.state_dict()
    backbone = load_file(files[family])
    adapted = {line.split(":")[0] for line in report.adapted}
    if freeze:  # the backbone trained not at all: it is the file's, tensor for tensor
        for k, v in backbone.items():
            if k not in adapted:
                torch.testing.assert_close(state[k], v, rtol=0, atol=0, msg=k)
    else:  # as loaded, before training: the file's
        start = fine_tune_start(family, files[family])
        for k, v in backbone.items():
            if k not in adapted:
                torch.testing.assert_close(start[k], v, rtol=0, atol=0, msg=k)
        assert any(not torch.equal(state[k], v) for k, v in backbone.items()), "the backbone did not train"
    tuned = cli.trainer.callback_metrics["val/top1"].item()
    scratch = fine_tune(family, data, tmp_path / "scratch", None, freeze).trainer.callback_metrics["val/top1"].item()
    print(f"{family} freeze={freeze}: from the backbone {tuned:.3f}, from random weights {scratch:.3f}")
    assert tuned >= 0.5, tuned  # chance is 1/3
    assert tuned >= scratch + 0.1, (tuned, scratch)
    head = "head.fc.weight" if family == "swin" else "head.weight"
    assert not torch.equal(state[head], fine_tune_start(family, files[family])[head]), "the head did not learn"


# -- a backbone is not a classifier; errors about the input are one line ------------------------------------------

@pytest.fixture(scope="module")
def random_backbone(tmp_path_factory) -> Path:
    """A tiny ViT saved by timm with num_classes=0 (random weights: only its layout matters here)."""
    _, preset, overrides = FAMILIES["vit"]
    path = tmp_path_factory.mktemp("random_backbone") / "backbone.safetensors"
    model = timm.create_model(preset, num_classes=0, img_size=32, **overrides)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)
    return path


@pytest.mark.parametrize("command", ["predict", "export"])
def test_predict_and_export_refuse_a_backbone_and_say_how_to_fine_tune_it(command, random_backbone, tmp_path):

    image = tmp_path / "digit.png"
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(image)
    _, preset, overrides = FAMILIES["vit"]
    args = ["--model", preset, "--overrides", str({**overrides, "img_size": 32}).replace("'", '"')]
    argv = ([command, str(image), "--checkpoint", str(random_backbone)] if command == "predict"
            else [command, str(random_backbone), "-o", str(tmp_path / "m.onnx")]) + args
    assert re.search(r"has no classifier head \(num_classes=0\): it is a backbone.*Fine-tune it "
                     r"first, e\.g\. `vitkit train fit .*--model.checkpoint .*backbone",
                     error_line_of(argv))
    assert re.search(r"holds no classifier for the 10 classes asked for \(new, untrained: "
                     r"head.bias, head.weight\)",
                     error_line_of([*argv[:-1], json.dumps({**overrides, "img_size": 32, "num_classes": 10})]))
    assert not (tmp_path / "m.onnx").exists()


def _train(*args: str) -> list[str]:
    return ["fit", "--config", str(ROOT / "configs/vit_tiny_digits.yaml"), "--trainer.accelerator", "cpu",
            "--trainer.max_steps", "1", *args]


@pytest.mark.slow
def test_the_training_command_reports_a_bad_checkpoint_path_in_one_line(tmp_path):
    out = forkserver.run(["-m", "vitkit.cli", "train", *_train(
        "--trainer.default_root_dir", str(tmp_path / "run"), "--model.checkpoint", str(tmp_path / "nope.pth"))],
        cwd=tmp_path, timeout=300)
    assert out.returncode == 1, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if "nope.pth" in line]
    assert errors == [f"error: checkpoint '{tmp_path / 'nope.pth'}' does not exist"], out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "Union" not in out.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("what", ["missing backbone key", "unknown preset"])
def test_the_training_command_names_what_is_wrong_with_the_model_once(what, random_backbone, tmp_path):
    _, preset, overrides = FAMILIES["vit"]
    if what == "missing backbone key":
        sd = load_file(random_backbone)
        save_file({k: v for k, v in sd.items() if k != "blocks.1.mlp.fc2.bias"}, tmp_path / "cut.safetensors")
        args = ["--model.checkpoint", str(tmp_path / "cut.safetensors")]
        expected = r"^error: .*does not fit the model.*missing from the checkpoint \(1\):\s+blocks.1"
    else:
        args = ["--model.model_name", "vit_tiny_patch16_2244"]
        expected = r"^error: unknown model 'vit_tiny_patch16_2244'; vitkit.list_models\(\) lists all"
    message = error_line_of(["train", *_train("--trainer.default_root_dir", str(tmp_path / "run"), *args)])
    assert re.search(expected, message, re.S) and "Union" not in message, message
    assert message.count("error:") == 1
