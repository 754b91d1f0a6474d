"""Training with Lightning: every config runs, DDP splits the data, resume continues the schedule,
and a tiny ViT actually learns the digits."""

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import vitkit
from tests.commands import error_line_of
from vitkit.cli.train import cli_main
from vitkit.errors import UsageError
from vitkit.lit import DigitsDataModule, ImageClassifier, ImageFolderDataModule, Recipe, SingleLabel

from ..hub_cache import cache_weights, use_offline_cache
from .conftest import PROBES, ROOT, TINY_VIT, run_on_two_nodes, write_few_shot_digits

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
CLASSIFIER_CONFIGS = [c for c in CONFIGS if yaml.safe_load(c.read_text())["model"]["class_path"].endswith(
    "ImageClassifier")]
TINY_SWIN = '{"embed_dim": 16, "depths": [1, 1], "num_heads": [1, 2], "window_size": 2, "patch_size": 2}'


def _cpu(tmp_path: Path) -> list[str]:
    return ["--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.num_nodes", "1",
            "--trainer.strategy", "auto", "--trainer.precision", "32-true",
            "--trainer.default_root_dir", str(tmp_path)]


@pytest.mark.slow
@pytest.mark.parametrize("config", CLASSIFIER_CONFIGS, ids=lambda p: p.stem)
def test_fast_dev_run_every_config_on_an_image_folder(config, image_folder, tmp_path, monkeypatch, request):
    tiny = TINY_SWIN if "swin" in config.stem else TINY_VIT
    cfg = yaml.safe_load(config.read_text())
    name = cfg["model"]["init_args"]["model_name"]
    if cfg["data"]["class_path"].endswith("StreamingImageDataModule"):  # the same images, as shards
        data = ["--data.root", str(request.getfixturevalue("shards"))]
    else:
        data = ["--data", "vitkit.lit.ImageFolderDataModule", "--data.root", str(image_folder)]
    from_file = []
    if "finetune" in config.stem and cfg["model"]["init_args"].get("pretrained"):  # the config's timm tag as it
        use_offline_cache(monkeypatch, tmp_path / "hf")  # stands, from a hub cache of tiny weights at 48 px
        cache_weights(tmp_path / "hf", name, vitkit.create_model(name, img_size=48, **json.loads(tiny)), tmp_path)
    elif "finetune" in config.stem:  # a recipe for a file the user gives: a tiny backbone saved without a head
        backbone = vitkit.create_model(name, img_size=48, num_classes=0, **json.loads(tiny))
        from_file = ["--model.checkpoint", str(vitkit.save_pretrained(backbone, tmp_path / "backbone"))]
    if cfg["model"]["init_args"].get("teacher"):  # the recipe's teacher as a tiny model of the folder's classes
        teacher = vitkit.create_model("vit_tiny_patch16_224", num_classes=3, img_size=32, **json.loads(TINY_VIT))
        from_file += ["--model.teacher.name", str(vitkit.save_pretrained(teacher, tmp_path / "teacher"))]
    cli = cli_main(["fit", "--config", str(config), *_cpu(tmp_path), "--trainer.fast_dev_run", "2",
                    "--model.model_overrides", tiny, "--model.recipe.compile", "false", *from_file,
                    *data, "--data.img_size", "32", "--data.batch_size", "4", "--data.num_workers", "0"])
    assert cli.model.num_classes == 3
    assert cli.model.hparams.class_names == ["class_0", "class_1", "class_2"]
    assert cli.trainer.global_step == 2 // cli.trainer.accumulate_grad_batches
    # the data is prepared as the weights were (mean, std, crop and interpolation of the preset or tag) but where the
    # recipe's data section says otherwise, and the model records what the data used, for predict and exports
    weights, data = vitkit.get_config(name), cli.datamodule.data_cfg
    keys = ("mean", "std", "crop_pct", "interpolation")
    expected = {k: tuple(v) if isinstance(v := cfg["data"]["init_args"].get(k, getattr(weights, k)), list) else v
                for k in keys}
    assert {k: getattr(data, k) for k in keys} == expected
    model_cfg = cli.model.model.cfg
    assert {k: tuple(v) if isinstance(v := getattr(model_cfg, k), list) else v for k in keys} == expected
    if "finetune" in config.stem:
        report = cli.model.model.load_report  # the tag's weights, with a new head for the folder's 3 classes
        headless = vitkit.get_config(name).num_classes == 0 or bool(from_file)  # DINOv3 ships no head
        note = "head: new (not in the checkpoint)" if headless else "new classifier"
        assert report.ok and any(note in a for a in report.adapted), report
        assert report.new_head and all(k.startswith("head.") for k in report.new_head), report


def test_demo_config_fast_dev_run_on_digits(tmp_path):
    cli = cli_main(["fit", "--config", str(ROOT / "configs/vit_tiny_digits.yaml"), *_cpu(tmp_path),
                    "--trainer.fast_dev_run", "2", "--model.model_overrides", TINY_VIT])
    assert cli.model.num_classes == 10 and cli.model.model.cfg.img_size == 32


def _fit(tmp_path: Path, *extra: str):
    return cli_main(["fit", "--config", str(ROOT / "configs/vit_tiny_digits.yaml"), *_cpu(tmp_path),
                     "--model.model_overrides", TINY_VIT, "--trainer.limit_train_batches", "3",
                     "--trainer.limit_val_batches", "2",
                     "--trainer.deterministic", "true", *extra])


@pytest.mark.slow
def test_resume_from_last_continues_step_schedule_and_weights(tmp_path):
    full = _fit(tmp_path / "full", "--trainer.max_epochs", "4")
    half = _fit(tmp_path / "resumed", "--trainer.max_epochs", "4",
                "--trainer.callbacks+=tests.tasks.ddp_probe.StopAfterEpoch", "--trainer.callbacks.epoch", "2")
    assert (tmp_path / "resumed/checkpoints/last.ckpt").exists()
    resumed = _fit(tmp_path / "resumed", "--trainer.max_epochs", "4", "--ckpt_path", "last")
    assert half.trainer.global_step == 6
    assert resumed.trainer.global_step == full.trainer.global_step == 12
    assert resumed.trainer.current_epoch == full.trainer.current_epoch
    lr = lambda cli: cli.trainer.optimizers[0].param_groups[0]["lr"]  # noqa: E731
    assert lr(resumed) == pytest.approx(lr(full))
    for a, b in zip(resumed.model.state_dict().values(), full.model.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_run_ending_by_max_steps_leaves_last_ckpt_and_a_second_run_cannot_replace_it(tmp_path):
    cli = _fit(tmp_path, "--trainer.max_steps", "2", "--trainer.val_check_interval", "1")
    assert cli.trainer.global_step == 2
    last = tmp_path / "checkpoints/last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 2
    before = last.read_bytes()
    with pytest.raises(UsageError, match=r"last\.ckpt belongs to an earlier run.*--ckpt_path last"):
        _fit(tmp_path, "--trainer.max_steps", "3")  # a new run into the same root
    assert last.read_bytes() == before and not list(tmp_path.glob("checkpoints/last-v*"))
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["version_0"]  # refused before writing
    resumed = _fit(tmp_path, "--trainer.max_steps", "3", "--ckpt_path", "last")  # resuming is the way in
    assert resumed.trainer.global_step == 3
    model = ImageClassifier.load_from_checkpoint(last)  # no CLI needed
    assert model.hparams.class_names == DigitsDataModule.classes
    assert model.model.cfg.img_size == 32
    assert "src_vocab_size" not in model.hparams  # what the CLI links for other modules is not kept


def test_a_batch_fitted_to_the_data_is_decided_before_the_module_is_built(tmp_path, monkeypatch):
    """StepsPerEpoch lowers the batch where an epoch would hold too few steps; the module is built with the LR of
    that batch (its hyper-parameters, saved at build, hold it), and the run's config.yaml says both."""
    built = []
    init = ImageClassifier.__init__

    def record(self, *args, **kwargs):
        built.append(kwargs["recipe"].lr)
        init(self, *args, **kwargs)

    monkeypatch.setattr(ImageClassifier, "__init__", record)
    cli = _fit(tmp_path, "--trainer.max_steps", "1", "--trainer.callbacks+=vitkit.lit.StepsPerEpoch",
               "--trainer.callbacks.min_steps", "100")
    n = len(cli.datamodule.train_set)
    new = max(4, n // 100)
    assert cli.datamodule.hparams.batch_size == new < 32
    assert built == [pytest.approx(3e-3 * (new / 32) ** 0.5)]  # AdamW's LR by the square root, at build
    assert cli.model.recipe.lr == pytest.approx(built[0])
    saved = yaml.safe_load((tmp_path / "logs/version_0/config.yaml").read_text())
    assert saved["data"]["init_args"]["batch_size"] == new
    assert saved["model"]["init_args"]["recipe"]["lr"] == pytest.approx(built[0])


def test_every_output_lives_under_default_root_dir_from_any_cwd(tmp_path, monkeypatch):
    """Two runs with different roots, started from an unrelated directory, with the config's own settings:
    each writes checkpoints, CSV log, curves and config under its root and nothing anywhere else."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    for name in ("a", "b"):
        cli_main(["fit", f"--config={ROOT / 'configs/vit_tiny_digits.yaml'}", "--trainer.accelerator=cpu",
                  f"--trainer.default_root_dir={tmp_path / name}", "--trainer.max_steps=2",
                  "--trainer.val_check_interval=2", "--trainer.limit_val_batches=1",
                  f"--model.model_overrides={TINY_VIT}"])
    assert not list(cwd.iterdir())
    for name in ("a", "b"):
        files = sorted(str(p.relative_to(tmp_path / name)) for p in (tmp_path / name).rglob("*") if p.is_file())
        assert "checkpoints/last.ckpt" in files and any(f.startswith("checkpoints/best-") for f in files), files
        for f in ("metrics.csv", "curves.png", "config.yaml", "hparams.yaml"):
            assert f"logs/version_0/{f}" in files, files


def test_default_root_is_runs_slash_config_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = cli_main(["-c", str(ROOT / "configs/vit_tiny_digits.yaml"), "--trainer.accelerator", "cpu",
                    "--trainer.max_steps", "1", "--model.model_overrides", TINY_VIT], run=False)
    assert cli.trainer.default_root_dir == "runs/vit_tiny_digits"
    assert cli.trainer.checkpoint_callback.dirpath == "runs/vit_tiny_digits/checkpoints"
    assert cli.trainer.logger.log_dir == "runs/vit_tiny_digits/logs/version_0"


def test_training_without_a_logger(tmp_path):
    from lightning.pytorch.callbacks import LearningRateMonitor

    cli = _fit(tmp_path, "--trainer.max_steps", "2", "--trainer.logger", "false")
    assert not cli.trainer.loggers and not any(isinstance(c, LearningRateMonitor) for c in cli.trainer.callbacks)
    assert (tmp_path / "checkpoints/last.ckpt").exists()


def test_progress_bar_off_although_the_config_names_one(tmp_path):
    """The configs list a RichProgressBar; --trainer.enable_progress_bar=false drops it instead of failing."""
    from lightning.pytorch.callbacks import ProgressBar

    cli = _fit(tmp_path, "--trainer.max_steps", "2", "--trainer.enable_progress_bar=false")
    assert cli.trainer.progress_bar_callback is None
    assert not any(isinstance(c, ProgressBar) for c in cli.trainer.callbacks)
    assert (tmp_path / "checkpoints/last.ckpt").exists()


def test_several_loggers_at_once(tmp_path):
    from lightning.pytorch.callbacks import LearningRateMonitor

    cli = _fit(tmp_path, "--trainer.max_steps", "2", "--trainer.log_every_n_steps", "1",
               "--trainer.logger+=lightning.pytorch.loggers.CSVLogger",
               "--trainer.logger.save_dir", str(tmp_path / "second"))
    assert [type(lg).__name__ for lg in cli.trainer.loggers] == ["CSVLogger", "CSVLogger"]
    assert sum(isinstance(c, LearningRateMonitor) for c in cli.trainer.callbacks) == 1
    rows = list(csv.DictReader(open(tmp_path / "logs/version_0/metrics.csv")))
    assert any(v for r in rows for k, v in r.items() if k.startswith("lr-"))
    assert (tmp_path / "second/lightning_logs/version_0/metrics.csv").exists()


@pytest.mark.slow
def test_wandb_logs_offline_without_an_account(tmp_path):
    _fit(tmp_path, "--trainer.max_steps", "1",
         "--trainer.logger+=lightning.pytorch.loggers.WandbLogger",
         "--trainer.logger.offline", "true", "--trainer.logger.project", "vitkit-test")
    runs = list((tmp_path / "wandb").glob("offline-run-*"))  # under the run's root, like everything else
    assert runs, list(tmp_path.rglob("*"))[:20]


@pytest.mark.slow
def test_ddp_on_two_nodes_splits_the_data_and_node_0_writes_the_one_checkpoint(tmp_path):
    """Two 1-process nodes on loopback (``NODE_RANK``, ``MASTER_ADDR``) into one shared root, as a launcher on
    each node of a 2-node job starts them: each rank trains on its own images, node 0 writes the checkpoints."""
    args = ["train.py", "fit", "--config", "configs/vit_tiny_digits.yaml", "--trainer.accelerator", "cpu",
            "--trainer.devices", "1", "--trainer.num_nodes", "2", "--trainer.strategy", "ddp",
            "--trainer.max_epochs", "1", "--trainer.limit_val_batches", "2", "--trainer.default_root_dir",
            str(tmp_path), "--model.model_overrides", TINY_VIT, "--data.augment", "false", "--data.batch_size", "32",
            "--trainer.callbacks+=ddp_probe.RecordSamples", "--trainer.callbacks.out_dir", str(tmp_path)]
    for node in run_on_two_nodes(args, env=PROBES, timeout=600):
        assert node.returncode == 0, node.stderr[-3000:]
    seen = [(tmp_path / f"rank{r}.txt").read_text().split() for r in (0, 1)]
    assert len(seen[0]) == len(seen[1]) > 0
    assert not set(seen[0]) & set(seen[1]), "ranks trained on the same images"
    dm = DigitsDataModule()
    dm.setup()
    assert len(seen[0]) + len(seen[1]) <= len(dm.train_set)
    ckpts = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert ckpts[-1] == "last.ckpt" and len(ckpts) == 2, ckpts  # one best + last, written by node 0 only


@pytest.mark.slow
def test_tiny_vit_learns_digits(digits_run):
    """20 epochs in under a minute of CPU take a chance-level model (0.10) far up. Over seeds 0-4, with the
    native and the AVX2 kernels, the last val top-1 was 0.82-0.97 and the last epoch's loss 0.28-0.44 of the
    first's; the bounds below sit well outside that spread."""
    top1 = digits_run.trainer.callback_metrics["val/top1"].item()
    assert top1 >= 0.5, top1
    rows = list(csv.DictReader(open(Path(digits_run.trainer.logger.log_dir) / "metrics.csv")))
    losses = [float(r["train/loss_epoch"]) for r in rows if r.get("train/loss_epoch")]
    assert losses[-1] < losses[0] * 0.8, losses


@pytest.mark.slow
def test_lightning_checkpoint_loads_without_lightning(digits_run):
    ckpt = Path(digits_run.trainer.checkpoint_callback.dirpath) / "last.ckpt"
    model = vitkit.create_model(checkpoint=ckpt).eval()  # name, overrides and classes from the hparams
    assert model.load_report.format == "lightning" and model.class_names == DigitsDataModule.classes
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(x), digits_run.model.model.eval()(x))


def test_the_command_lines_model_arguments_are_told_from_the_rest():
    from vitkit.cli.train import given_model_args

    args = ["validate", "--model.recipe.lr", "1e-3", "--model.recipe.ema_decay=0.9", "--model.model_overrides.depth=6",
            "--model.class_path", "vitkit.lit.ImageClassifier", "--data.batch_size", "8", "--ckpt_path", "x.ckpt"]
    assert given_model_args(args) == {"recipe", "model_overrides"}


def test_a_command_builds_the_parser_of_its_subcommand_and_help_lists_all_four(tmp_path, capsys):
    """``fit ...`` builds fit's parser alone (each subcommand's is the trainer's, the module's and the data's
    arguments over again); ``--help`` still lists all four."""
    config = str(ROOT / "configs/vit_tiny_digits.yaml")
    fit = cli_main(["fit", "--config", config, *_cpu(tmp_path), "--model.model_overrides", TINY_VIT,
                    "--trainer.fast_dev_run", "true"])
    assert list(fit._subcommand_parsers) == ["fit"] and fit.trainer.state.finished
    with pytest.raises(SystemExit):
        cli_main(["--help"])
    assert "{fit,validate,test,predict}" in capsys.readouterr().out


@pytest.mark.slow
def test_token_merging_validates_in_the_classifier_as_the_bench_curve_measures_it(digits_run, tmp_path):
    """The bench's token-merging curve on the digits checkpoint: unmerged, its top-1 is Lightning's validation
    top-1 of the same weights; merged (r=16: the 64 patches halved by the last block), the classifier's validation
    with the merging set from the command line gives the curve's top-1 too, with fewer GMACs."""
    from vitkit.cli.bench import measure as bench

    ckpt = Path(digits_run.trainer.checkpoint_callback.dirpath) / "last.ckpt"
    rows = bench(["--checkpoint", str(ckpt), "--token-merging", "0,16", "--batch-sizes", "64", "--rounds", "1",
                  "--iters", "1", "--out", str(tmp_path / "curve.csv")])
    assert rows[0]["top1"] == pytest.approx(digits_run.trainer.callback_metrics["val/top1"].item(), abs=1e-4)
    assert [r["tokens_last_block"] for r in rows] == [65, 33] and rows[1]["gmacs"] < 0.8 * rows[0]["gmacs"]
    assert (tmp_path / "curve.png").stat().st_size > 0 and rows[1]["val_images"] == 360
    merged = cli_main(["validate", "--config", str(ROOT / "configs/vit_tiny_digits.yaml"), *_cpu(tmp_path),
                       "--model.model_overrides.token_merging=16", "--ckpt_path", str(ckpt)])
    assert merged.model.model.merge_r == [16, 16]
    assert merged.trainer.callback_metrics["val/top1"].item() == pytest.approx(rows[1]["top1"], abs=1e-4)


@pytest.fixture(scope="module")
def few_shot_folder(tmp_path_factory) -> Path:
    return write_few_shot_digits(tmp_path_factory.mktemp("few_shot"))


def fine_tune_args(root: Path, data: Path, *extra: str) -> list[str]:
    return ["fit", "--config", str(ROOT / "configs/vit_tiny_digits.yaml"), *_cpu(root), "--trainer.max_epochs", "10",
            "--trainer.check_val_every_n_epoch", "10", "--model.recipe.warmup_epochs", "0", "--model.recipe.lr", "2e-3",
            "--model.recipe.layer_decay", "0.65", *extra,
            "--data", "vitkit.lit.ImageFolderDataModule", "--data.root", str(data), "--data.img_size", "40",
            "--data.batch_size", "3", "--data.num_workers", "0", "--data.auto_augment", "null", "--data.re_prob", "0",
            "--data.scale", "[0.8, 1.0]", "--data.hflip", "0"]


@pytest.mark.slow
def test_fine_tuning_from_the_digits_checkpoint_beats_scratch(digits_run, few_shot_folder, tmp_path):
    """Fine-tune the digits model on a new 3-class folder at another resolution (so the positions are
    resampled and the head replaced) with 8 images per class; from scratch the same run stays far behind.
    Over fine-tuning seeds 0-4 from a 20-epoch digits run, validated after the last epoch only, fine-tuned reached
    0.950-1.000 and scratch 0.233-0.458 on the 120 validation images, a gap of 0.533-0.767."""
    ckpt = Path(digits_run.trainer.checkpoint_callback.dirpath) / "last.ckpt"
    cli = cli_main(fine_tune_args(tmp_path / "tuned", few_shot_folder, "--model.checkpoint", str(ckpt)))
    tuned = cli.trainer.callback_metrics["val/top1"].item()
    adapted = " ".join(cli.model.model.load_report.adapted)
    assert "pos_embed: resampled (bicubic) from a 8x8 to a 10x10 patch grid" in adapted
    assert "head.weight: new classifier (3, 96)" in adapted
    scratch = cli_main(fine_tune_args(tmp_path / "scratch", few_shot_folder)).trainer.callback_metrics["val/top1"]
    print(f"fine-tuned {tuned:.3f} vs scratch {scratch.item():.3f}")
    assert tuned >= scratch.item() + 0.15, (tuned, scratch.item())


def test_data_modules_give_classes_before_setup(image_folder):
    dm = ImageFolderDataModule(str(image_folder), img_size=32, model_name="deit_tiny_patch16_224")
    assert dm.num_classes == 3 and dm.classes == ["class_0", "class_1", "class_2"]
    assert dm.data_cfg.mean == (0.485, 0.456, 0.406) and dm.data_cfg.crop_pct == 0.9
    dm.setup()
    x, y = dm.train_set[0]
    assert x.shape == (3, 32, 32) and y == 0
    assert json.dumps(dm.hparams["scale"]) == "null"  # left to the image size: a 32 px image gets a mild crop alone
    assert dm.augmentation() == {"auto_augment": None, "re_prob": 0.0, "scale": (0.8, 1.0), "hflip": 0.0,
                                 "color_jitter": None}


@pytest.mark.parametrize("form", ["--config=", "-c", "two"])
def test_the_config_picks_the_module_in_every_argument_form(form, tmp_path):
    """--config=x, -c x and several --config files: the module comes from the config's class path."""
    seq2seq = ROOT / "configs/seq2seq_reverse.yaml"
    if form == "two":  # a later file overrides an earlier one, the model's class path included
        small = tmp_path / "small.yaml"
        small.write_text("data:\n  init_args: {num_train: 64, num_val: 16, batch_size: 8}\n")
        args = ["--config", str(ROOT / "configs/vit_tiny_digits.yaml"), "--config", str(seq2seq),
                "--config", str(small)]
    else:
        args = [f"--config={seq2seq}"] if form == "--config=" else ["-c", str(seq2seq)]
        args += ["--data.num_train", "64", "--data.num_val", "16", "--data.batch_size", "8"]
    cli = cli_main(["fit", *args, *_cpu(tmp_path), "--trainer.fast_dev_run", "1"])
    assert type(cli.model).__name__ == "Seq2SeqModule" and cli.trainer.global_step == 1


def test_an_encoder_decoder_preset_in_the_classifier_is_named(tmp_path):
    with pytest.raises(ValueError, match="'transformer_tiny' is an encoder-decoder preset; .*Seq2SeqModule"):
        ImageClassifier(model_name="transformer_tiny")


@pytest.mark.slow
def test_ema_updates_once_per_optimizer_step_and_never_for_a_skipped_one(tmp_path):
    import sys

    sys.path.insert(0, str(ROOT / "tests" / "tasks"))
    cli = _fit(tmp_path / "accumulate", "--model.recipe.ema_decay", "0.9", "--trainer.accumulate_grad_batches", "2",
               "--trainer.max_epochs", "2")  # 3 batches per epoch: 2 optimizer steps each
    assert cli.trainer.global_step == 4 and int(cli.model.ema.updates) == 4
    cli = _fit(tmp_path / "skip", "--model.recipe.ema_decay", "0.9", "--model.recipe.nonfinite_loss", "skip",
               "--trainer.max_epochs", "2", "--trainer.callbacks+=ddp_probe.NanLogitsOnce",
               "--trainer.callbacks.step", "2")
    assert cli.trainer.global_step == 6 and int(cli.model.ema.updates) == 5
    assert all(torch.isfinite(p).all() for p in cli.model.ema.parameters())


@pytest.mark.slow
def test_an_ema_that_is_the_model_is_what_evaluation_runs_and_the_checkpoint_holds_and_resume_puts_back(tmp_path):
    """``ema_is_model``: eval mode runs the average, the checkpoint's ``model.`` weights are the average's (what
    predict, evaluate and export read), and a resumed run trains the weights it was training, exactly."""
    ema = ("--model.recipe.ema_decay", "0.5", "--model.recipe.ema_is_model", "true", "--trainer.max_epochs", "2")
    full = _fit(tmp_path / "full", *ema)
    _fit(tmp_path / "resumed", *ema, "--trainer.callbacks+=tests.tasks.ddp_probe.StopAfterEpoch",
         "--trainer.callbacks.epoch", "1")
    resumed = _fit(tmp_path / "resumed", *ema, "--ckpt_path", "last")
    assert resumed.trainer.global_step == full.trainer.global_step == 6
    for a, b in zip(resumed.model.state_dict().values(), full.model.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    module = full.model.eval()
    saved = torch.load(tmp_path / "full/checkpoints/last.ckpt", weights_only=True)["state_dict"]
    for key, value in module.ema.module.state_dict().items():
        torch.testing.assert_close(saved[f"model.{key}"], value)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert not torch.allclose(module.model(x), module.ema.module(x))
        torch.testing.assert_close(module(x), module.ema.module(x))
        loaded = vitkit.create_model(checkpoint=tmp_path / "full/checkpoints/last.ckpt").eval()
        torch.testing.assert_close(loaded(x), module.ema.module(x), atol=1e-5, rtol=1e-5)
        again = ImageClassifier.load_from_checkpoint(tmp_path / "full/checkpoints/last.ckpt").eval()
        for run in (again.model, again.ema.module, again):  # loaded to be used: the average, wherever a user looks
            torch.testing.assert_close(run(x), module.ema.module(x), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="give ema_decay too"):
        ImageClassifier(model_name="vit_tiny_patch16_224", recipe=Recipe(lr=5e-4, weight_decay=0.05, ema_is_model=True))
    for decay in (1.5, -0.5, 1.0):  # the average would run away, or never move
        with pytest.raises(ValueError, match=rf"ema_decay must be in \(0, 1\) .*got {decay}"):
            ImageClassifier(model_name="vit_tiny_patch16_224",
                            recipe=Recipe(lr=5e-4, weight_decay=0.05, ema_decay=decay, ema_is_model=True))


@pytest.mark.slow
def test_compiled_training_checkpoints_plain_parameter_names(tmp_path):
    cli = _fit(tmp_path, "--model.recipe.compile", "true", "--trainer.max_steps", "2", "--trainer.limit_val_batches",
               "0")
    assert cli.model.model._compiled_call_impl is not None  # trained compiled
    last = tmp_path / "checkpoints/last.ckpt"
    keys = list(torch.load(last, weights_only=True)["state_dict"])
    assert keys and all(k.startswith("model.") and "_orig_mod" not in k for k in keys), keys[:5]
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        # the weights, run eagerly (``forward``: the trained module and the loaded one are compiled, and calling
        # them would compile each again for inference)
        ref = cli.model.model.eval().forward(x)
        torch.testing.assert_close(vitkit.create_model(checkpoint=last).eval()(x), ref)
        torch.testing.assert_close(ImageClassifier.load_from_checkpoint(last).model.eval().forward(x), ref)


@pytest.mark.slow
def test_test_evaluates_a_held_out_split_and_says_which(tmp_path, caplog):
    import logging

    fit = _fit(tmp_path, "--trainer.max_steps", "3", "--data.test_fraction", "0.1")
    dm = fit.datamodule
    assert (len(dm.test_set), len(dm.val_set), len(dm.train_set)) == (180, 324, 1293)  # 1,797 digits, held apart
    with caplog.at_level(logging.INFO):
        cli = cli_main(["test", "--config", str(ROOT / "configs/vit_tiny_digits.yaml"), *_cpu(tmp_path),
                        "--model.model_overrides", TINY_VIT, "--data.test_fraction", "0.1", "--ckpt_path", "last"])
    assert "test: evaluating the test split of DigitsDataModule" in caplog.text
    assert "test/top1" in cli.trainer.callback_metrics
    for other in (["--data.test_fraction", "0.2"], ["--data.seed", "1", "--data.test_fraction", "0.1"]):
        # another carving of the same digits: its test split holds digits the run trained on
        line = error_line_of(["train", "test", "--config", str(ROOT / "configs/vit_tiny_digits.yaml"),
                              *_cpu(tmp_path), "--model.model_overrides", TINY_VIT, *other, "--ckpt_path", "last"])
        assert "last.ckpt was trained with --data." in line and "holds data that run trained on" in line, line


def test_image_folder_test_split(image_folder, tmp_path, caplog):
    import logging
    import shutil

    root = tmp_path / "data"
    shutil.copytree(image_folder, root)
    dm = ImageFolderDataModule(str(root), img_size=32)
    dm.setup()
    assert dm.test_set is None  # no test/ folder: test runs on val, and says so
    with caplog.at_level(logging.INFO):
        dm.test_dataloader()
    assert "has no test split; evaluating its val split" in caplog.text
    shutil.copytree(root / "val", root / "test")
    (root / "test/class_2").rename(root / "test/class_9")
    with pytest.raises(ValueError, match="test class folders differ from train"):
        ImageFolderDataModule(str(root))
    (root / "test/class_9").rename(root / "test/class_2")
    dm = ImageFolderDataModule(str(root), img_size=32)
    dm.setup()
    assert len(dm.test_set) == len(dm.val_set) and dm.test_set.folder.root.endswith("test")


def test_mixup_takes_an_odd_batch():
    """timm's Mixup takes even batches only; an odd last batch is mixed but for its last image, which keeps its
    own smoothed target, and the even part is mixed exactly as timm mixes it."""
    from timm.data.mixup import mixup_target

    m = ImageClassifier(model_overrides=json.loads(TINY_VIT), num_classes=3, img_size=16,
                        labels=SingleLabel(label_smoothing=0.1, mixup=0.8, cutmix=1.0))
    x, y = torch.randn(5, 3, 16, 16), torch.tensor([0, 1, 2, 0, 1])
    np.random.seed(0)  # timm's Mixup draws from NumPy
    mixed, soft = x.clone(), m.labels.mix(m.mixup, x_ := x.clone(), y)
    np.random.seed(0)
    want_x, want_soft = m.mixup(x[:4].clone(), y[:4])
    torch.testing.assert_close(x_[:4], want_x)
    torch.testing.assert_close(soft[:4], want_soft)
    torch.testing.assert_close(x_[4], mixed[4])  # the odd one out is not mixed
    torch.testing.assert_close(soft[4], mixup_target(y[4:], 3, smoothing=0.1)[0])
    assert torch.isfinite(m._loss(torch.randn(1, 3, 16, 16), torch.tensor([2])))  # a batch of one
