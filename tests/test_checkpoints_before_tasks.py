"""Checkpoints of every task, written by vitkit before its training modules moved into task packages and took typed
parts (``tests/fixtures/before_tasks/README.md`` says how), once upgraded by ``vitkit convert``: the module their
stored class path names rebuilds the same network, which gives the outputs the old code gave; `vitkit evaluate`
scores them as it did (a classifier's file even before it is upgraded); a run resumes from one."""

import importlib
import json
from pathlib import Path

import pytest
import torch

from tests.commands import run_cli

OLD = Path(__file__).parent / "fixtures" / "before_tasks"
TASKS = sorted(p.stem for p in OLD.glob("*.ckpt"))


def load(path: Path):
    """The Lightning module a checkpoint's stored class path names, loaded from it (as `vitkit` loads one)."""
    hp = torch.load(path, map_location="cpu", weights_only=True)["hyper_parameters"]
    module, _, cls = hp["_class_path"].rpartition(".")
    torch.manual_seed(0)  # a LoRA file holds only its adapters and head: the base it adapts is built anew
    return getattr(importlib.import_module(module), cls).load_from_checkpoint(path, map_location="cpu").eval()


@torch.no_grad()
def outputs(module) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    name = type(module).__name__
    if name == "Seq2SeqModule":
        return module(torch.randint(4, 10, (2, 7), generator=g), torch.randint(4, 10, (2, 5), generator=g))
    x = torch.rand(2, 3, 32, 32, generator=g)
    if name == "ImageClassifier":
        return module(x)
    torch.manual_seed(0)
    if name == "MaskedImageModeling":
        out = module(x)
        return torch.cat([out.loss.reshape(1), out.pred.flatten()])
    if name == "DINOPretraining":
        return module.model.student(x)
    raise TypeError(name)


def test_every_task_has_an_old_checkpoint():
    assert set(TASKS) >= {"classifier", "multilabel", "lora", "distilled", "probe", "small_data", "mae", "dino",
                          "seq2seq"}


@pytest.mark.parametrize("task", TASKS)
def test_an_old_checkpoint_gives_the_outputs_it_gave(task, upgraded):
    expected = torch.load(OLD / "outputs.pt", weights_only=True)[task]
    torch.testing.assert_close(outputs(load(upgraded(OLD / f"{task}.ckpt"))), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("task, metric", [("classifier", "top1"), ("multilabel", "mAP")])
def test_evaluate_scores_an_old_checkpoint_as_it_did(task, metric, tmp_path, capsys):
    status, err = run_cli(["evaluate", "--checkpoint", str(OLD / f"{task}.ckpt"), "--data",
                           "vitkit.lit.DigitsDataModule", "--data.img_size", "32", "-o", str(tmp_path)], capsys)
    assert status == 0, err
    got = json.loads((tmp_path / "metrics.json").read_text())[metric]
    assert got == pytest.approx(json.loads((OLD / "evaluate.json").read_text())[task][metric], abs=1e-6)


@pytest.mark.slow
def test_a_run_resumes_from_an_old_checkpoint(tmp_path, capsys, upgraded):
    from vitkit.cli.train import cli_main

    cli_main(["fit", "-c", "vit_tiny_digits", "--model.model_overrides",
              '{"depth": 1, "embed_dim": 32, "num_heads": 2, "patch_size": 8}', "--trainer.accelerator", "cpu",
              "--trainer.devices", "1", "--trainer.precision", "32-true", "--trainer.enable_progress_bar", "false",
              "--trainer.max_steps", "4", "--trainer.limit_val_batches", "1", "--trainer.val_check_interval", "2",
              "--trainer.default_root_dir", str(tmp_path), "--ckpt_path", str(upgraded(OLD / "classifier.ckpt"))])
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert last["global_step"] == 4  # two steps were in the old file, two more ran
