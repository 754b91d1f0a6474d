"""Training with Lightning: every config runs, DDP splits the data, resume continues the schedule,
and a tiny ViT actually learns the digits."""

import csv
import json
from pathlib import Path

import pytest
import torch
import yaml

import vitkit
from vitkit.lit import DigitsDataModule, ImageClassifier, ImageFolderDataModule
from vitkit.lit.cli import cli_main

from .conftest import ROOT, TINY_VIT, run_in_repo

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
CLASSIFIER_CONFIGS = [c for c in CONFIGS if not c.name.startswith(("seq2seq", "transformer", "ocr"))]
TINY_SWIN = '{"embed_dim": 16, "depths": [1, 1], "num_heads": [1, 2], "window_size": 2, "patch_size": 2}'


def _cpu(tmp_path: Path) -> list[str]:
    return ["--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.num_nodes", "1",
            "--trainer.strategy", "auto", "--trainer.precision", "32-true",
            "--trainer.default_root_dir", str(tmp_path)]


@pytest.mark.parametrize("config", CLASSIFIER_CONFIGS, ids=lambda p: p.stem)
def test_fast_dev_run_every_config_on_an_image_folder(config, image_folder, tmp_path):
    tiny = TINY_SWIN if "swin" in config.stem else TINY_VIT
    extra = []
    if "finetune" in config.stem:  # start from an export of the same (tiny) preset at another size
        name = yaml.safe_load(config.read_text())["model"]["model_name"]
        vitkit.save_pretrained(vitkit.create_model(name, img_size=48, **json.loads(tiny)), tmp_path / "pre")
        extra = ["--model.checkpoint", str(tmp_path / "pre")]
    cli = cli_main(["fit", "--config", str(config), *_cpu(tmp_path), "--trainer.fast_dev_run", "2",
                    "--model.model_overrides", tiny, "--model.compile", "false", *extra,
                    "--data", "vitkit.lit.ImageFolderDataModule", "--data.root", str(image_folder),
                    "--data.img_size", "32", "--data.batch_size", "4", "--data.num_workers", "0"])
    assert cli.model.num_classes == 3
    assert cli.model.hparams.class_names == ["class_0", "class_1", "class_2"]
    assert cli.trainer.global_step == 2 // cli.trainer.accumulate_grad_batches


def test_demo_config_fast_dev_run_on_digits(tmp_path):
    cli = cli_main(["fit", "--config", str(ROOT / "configs/vit_tiny_digits.yaml"), *_cpu(tmp_path),
                    "--trainer.fast_dev_run", "2", "--model.model_overrides", TINY_VIT])
    assert cli.model.num_classes == 10 and cli.model.model.cfg.img_size == 32


def _fit(tmp_path: Path, *extra: str):
    ckpt_dir = tmp_path / "ckpt"
    return cli_main(["fit", "--config", str(ROOT / "configs/vit_tiny_digits.yaml"), *_cpu(tmp_path),
                     "--model.model_overrides", TINY_VIT, "--trainer.limit_train_batches", "3",
                     "--trainer.limit_val_batches", "2",
                     "--trainer.callbacks.dirpath", str(ckpt_dir), "--trainer.logger.save_dir", str(tmp_path),
                     "--trainer.deterministic", "true", *extra])


def test_resume_from_last_continues_step_schedule_and_weights(tmp_path):
    full = _fit(tmp_path / "full", "--trainer.max_epochs", "4")
    half = _fit(tmp_path / "resumed", "--trainer.max_epochs", "4",
                "--trainer.callbacks+=tests.lit.ddp_probe.StopAfterEpoch", "--trainer.callbacks.epoch", "2")
    assert (tmp_path / "resumed/ckpt/last.ckpt").exists()
    resumed = _fit(tmp_path / "resumed", "--trainer.max_epochs", "4", "--ckpt_path", "last")
    assert half.trainer.global_step == 6
    assert resumed.trainer.global_step == full.trainer.global_step == 12
    assert resumed.trainer.current_epoch == full.trainer.current_epoch
    lr = lambda cli: cli.trainer.optimizers[0].param_groups[0]["lr"]  # noqa: E731
    assert lr(resumed) == pytest.approx(lr(full))
    for a, b in zip(resumed.model.state_dict().values(), full.model.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_run_ending_by_max_steps_leaves_last_ckpt(tmp_path):
    _fit(tmp_path, "--trainer.max_steps", "1", "--trainer.val_check_interval", "1")
    cli = _fit(tmp_path, "--trainer.max_steps", "2", "--trainer.val_check_interval", "1")  # a second run, same folder
    assert cli.trainer.global_step == 2 // cli.trainer.accumulate_grad_batches
    assert not list((tmp_path / "ckpt").glob("last-v*.ckpt"))  # the newer run replaced last.ckpt
    assert torch.load(tmp_path / "ckpt/last.ckpt", weights_only=True)["global_step"] == 2
    model = ImageClassifier.load_from_checkpoint(tmp_path / "ckpt/last.ckpt")  # no CLI needed
    assert model.hparams.class_names == DigitsDataModule.classes
    assert model.model.cfg.img_size == 32


def test_wandb_logs_offline_without_an_account(tmp_path):
    _fit(tmp_path, "--trainer.max_steps", "1",
         "--trainer.logger+=lightning.pytorch.loggers.WandbLogger",
         "--trainer.logger.offline", "true", "--trainer.logger.save_dir", str(tmp_path / "wb"),
         "--trainer.logger.project", "vitkit-test")
    runs = list((tmp_path / "wb" / "wandb").glob("offline-run-*"))
    assert runs, list((tmp_path / "wb").rglob("*"))[:20]


def test_ddp_two_cpu_processes_split_the_data_and_write_one_checkpoint(tmp_path):
    args = ["train.py", "fit", "--config", "configs/vit_tiny_digits.yaml", "--trainer.accelerator", "cpu",
            "--trainer.devices", "2", "--trainer.strategy", "ddp", "--trainer.max_epochs", "1",
            "--trainer.limit_val_batches", "2",
            "--model.model_overrides", TINY_VIT, "--data.augment", "false", "--data.batch_size", "32",
            "--trainer.callbacks.dirpath", str(tmp_path / "ckpt"), "--trainer.logger.save_dir", str(tmp_path),
            "--trainer.callbacks+=ddp_probe.RecordSamples", "--trainer.callbacks.out_dir", str(tmp_path)]
    out = run_in_repo(args, env={"PYTHONPATH": str(ROOT / "tests" / "lit")}, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = [(tmp_path / f"rank{r}.txt").read_text().split() for r in (0, 1)]
    assert len(seen[0]) == len(seen[1]) > 0
    assert not set(seen[0]) & set(seen[1]), "ranks trained on the same images"
    dm = DigitsDataModule()
    dm.setup()
    assert len(seen[0]) + len(seen[1]) <= len(dm.train_set)
    ckpts = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert ckpts[-1] == "last.ckpt" and len(ckpts) == 2, ckpts  # one best + last, written by rank 0 only


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("digits")
    return cli_main(["fit", "--config", str(ROOT / "configs/vit_tiny_digits.yaml"), *_cpu(tmp_path),
                     "--trainer.max_epochs", "12",
                     "--model.warmup_epochs", "1", "--trainer.callbacks.dirpath", str(tmp_path / "ckpt"),
                     "--trainer.logger.save_dir", str(tmp_path)])


def test_tiny_vit_learns_digits(digits_run):
    """The learning curve reaches the accuracy: >= 0.90 val top-1 in well under a minute of CPU."""
    top1 = digits_run.trainer.callback_metrics["val/top1"].item()
    assert top1 >= 0.90, top1
    rows = list(csv.DictReader(open(Path(digits_run.trainer.logger.log_dir) / "metrics.csv")))
    losses = [float(r["train/loss_epoch"]) for r in rows if r.get("train/loss_epoch")]
    assert losses[-1] < losses[0] * 0.6


def test_lightning_checkpoint_loads_without_lightning(digits_run):
    ckpt = Path(digits_run.trainer.checkpoint_callback.dirpath) / "last.ckpt"
    model = vitkit.create_model(checkpoint=ckpt).eval()  # name, overrides and classes from the hparams
    assert model.load_report.format == "lightning" and model.class_names == DigitsDataModule.classes
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(x), digits_run.model.model.eval()(x))


def test_fine_tuning_from_the_digits_checkpoint_beats_scratch(digits_run, image_folder, tmp_path):
    """Fine-tune the digits model on a new 3-class folder of PNG/JPEG files at another resolution (so the
    positions are resampled and the head replaced) for 10 epochs of 6 steps; from scratch it stays far behind."""
    ckpt = Path(digits_run.trainer.checkpoint_callback.dirpath) / "last.ckpt"

    def fit(*extra):
        cli = cli_main(["fit", "--config", str(ROOT / "configs/vit_tiny_digits.yaml"), *_cpu(tmp_path),
                        "--trainer.max_epochs", "10", "--trainer.callbacks.dirpath", str(tmp_path / "ckpt"),
                        "--trainer.logger.save_dir", str(tmp_path), "--model.warmup_epochs", "0",
                        "--model.lr", "2e-3", "--model.layer_decay", "0.65", *extra,
                        "--data", "vitkit.lit.ImageFolderDataModule", "--data.root", str(image_folder),
                        "--data.img_size", "40", "--data.batch_size", "3", "--data.num_workers", "0",
                        "--data.auto_augment", "null", "--data.re_prob", "0", "--data.scale", "[0.8, 1.0]",
                        "--data.hflip", "0"])
        return cli.trainer.callback_metrics["val/top1"].item(), cli

    tuned, cli = fit("--model.checkpoint", str(ckpt))
    adapted = " ".join(cli.model.model.load_report.adapted)
    assert "pos_embed: resampled (bicubic) from a 8x8 to a 10x10 patch grid" in adapted
    assert "head.weight: new classifier (3, 96)" in adapted
    scratch, _ = fit()
    print(f"fine-tuned {tuned:.3f} vs scratch {scratch:.3f}")
    assert tuned >= 0.7 and tuned >= scratch + 0.3, (tuned, scratch)


def test_data_modules_give_classes_before_setup(image_folder):
    dm = ImageFolderDataModule(str(image_folder), img_size=32, model_name="deit_tiny_patch16_224")
    assert dm.num_classes == 3 and dm.classes == ["class_0", "class_1", "class_2"]
    assert dm.data_cfg.mean == (0.485, 0.456, 0.406) and dm.data_cfg.crop_pct == 0.9
    dm.setup()
    x, y = dm.train_set[0]
    assert x.shape == (3, 32, 32) and y == 0
    assert json.dumps(dm.hparams["scale"]) == "[0.08, 1.0]"
