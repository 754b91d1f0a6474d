"""Faults during training: unreadable images are skipped and counted, a NaN loss stops or skips as
configured, a SIGKILLed run resumes to the same end, a failing DDP rank ends the job, and config
mistakes are named before any work starts."""

import logging
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from vitkit.cli.train import cli_main
from vitkit.errors import UsageError

from ..commands import error_line_of
from .conftest import PROBES, ROOT, TINY_VIT, run_in_repo


def _cpu(tmp_path: Path) -> list[str]:
    return ["--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.strategy", "auto",
            "--trainer.precision", "32-true", "--trainer.default_root_dir", str(tmp_path)]


def _folder_fit(root: Path, tmp_path: Path, *extra: str):
    return cli_main(["fit", "--config", str(ROOT / "configs/vit_tiny_digits.yaml"), *_cpu(tmp_path),
                     "--model.model_overrides", TINY_VIT, "--trainer.max_epochs", "1",
                     "--data", "vitkit.lit.ImageFolderDataModule", "--data.root", str(root), "--data.img_size", "32",
                     "--data.batch_size", "4", "--data.num_workers", "0", *extra])


def test_unreadable_images_are_skipped_counted_and_logged(image_folder, tmp_path, caplog):
    root = tmp_path / "data"
    shutil.copytree(image_folder, root)
    good = next((root / "train/class_0").glob("*.png"))
    (root / "train/class_0/truncated.png").write_bytes(good.read_bytes()[:60])
    (root / "train/class_1/notes.jpg").write_text("not an image")
    (root / "train/class_2/noise.png").write_bytes(bytes(range(256)) * 4)
    (root / "val/class_1/empty.jpg").write_bytes(b"")
    with caplog.at_level(logging.WARNING):
        cli = _folder_fit(root, tmp_path)
    assert cli.trainer.current_epoch == 1  # the epoch finished
    assert cli.trainer.callback_metrics["train/skipped_files"] == 3
    assert cli.trainer.callback_metrics["val/skipped_files"] == 1
    assert "train: skipped 3 unreadable image file(s) this epoch (17 used); add --verbose to the command" in \
        caplog.text  # 21 files, drop_last: 20; and how to see which


def test_verbose_shows_vitkits_debug_lines_and_leaves_the_command_line(monkeypatch):
    from vitkit.errors import take_verbose_flag

    monkeypatch.setenv("VITKIT_VERBOSE", "0")  # the flag sets it to 1; the test's end puts it back

    logger = logging.getLogger("vitkit")
    before, handlers = logger.level, list(logger.handlers)
    try:
        assert take_verbose_flag(["fit", "--verbose", "-c", "x"]) == ["fit", "-c", "x"]
        assert logger.isEnabledFor(logging.DEBUG) and logger.handlers
        assert os.environ["VITKIT_VERBOSE"] == "1"  # for the processes a multi-device run starts
    finally:
        logger.setLevel(before)
        logger.handlers[:] = handlers


def test_a_split_with_no_readable_image_is_an_error(image_folder, tmp_path):
    root = tmp_path / "data"
    shutil.copytree(image_folder, root)
    for f in (root / "train").rglob("*.*"):
        f.write_bytes(b"broken")
    with pytest.raises(RuntimeError, match=r"no usable images in .*train: all \d+ files read this epoch"):
        _folder_fit(root, tmp_path)


def _digits_fit(tmp_path: Path, *extra: str):
    return cli_main(["fit", "--config", str(ROOT / "configs/vit_tiny_digits.yaml"), *_cpu(tmp_path),
                     "--model.model_overrides", TINY_VIT, "--trainer.limit_train_batches", "3",
                     "--trainer.limit_val_batches", "1", "--trainer.max_epochs", "3", *extra])


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    import sys

    sys.path.insert(0, str(ROOT / "tests" / "tasks"))
    with pytest.raises(FloatingPointError, match=r"non-finite training loss \(nan\) at global step 4.*left as it was"):
        _digits_fit(tmp_path, "--trainer.callbacks+=ddp_probe.PoisonWeights", "--trainer.callbacks.step", "4")
    ckpt = torch.load(tmp_path / "checkpoints/last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 3  # written at the end of epoch 0, before the poison
    assert all(torch.isfinite(v).all() for v in ckpt["state_dict"].values() if v.is_floating_point())


def test_nan_loss_skip_policy_drops_one_bad_step_and_finishes(tmp_path, caplog):
    import sys

    sys.path.insert(0, str(ROOT / "tests" / "tasks"))
    with caplog.at_level(logging.WARNING):
        cli = _digits_fit(tmp_path, "--model.recipe.nonfinite_loss", "skip",
                          "--trainer.callbacks+=ddp_probe.NanLogitsOnce", "--trainer.callbacks.step", "4")
    assert "skipping step 4: non-finite training loss nan" in caplog.text
    assert cli.trainer.global_step == 9 and cli.trainer.current_epoch == 3
    assert all(torch.isfinite(p).all() for p in cli.model.parameters())


def test_nan_loss_skip_policy_drops_steps_then_gives_up(tmp_path, caplog):
    import sys

    sys.path.insert(0, str(ROOT / "tests" / "tasks"))
    with caplog.at_level(logging.WARNING), pytest.raises(FloatingPointError, match="11 steps in a row"):
        _digits_fit(tmp_path, "--model.recipe.nonfinite_loss", "skip", "--trainer.max_epochs", "6",
                    "--trainer.callbacks+=ddp_probe.PoisonWeights", "--trainer.callbacks.step", "4")
    # each skipped step leaves the weights alone (no gradients) while the step counter moves on
    assert [f"skipping step {s}: non-finite training loss nan" in caplog.text for s in range(4, 14)] == [True] * 10
    assert caplog.text.count("skipping step") == 10


@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume_ends_like_an_uninterrupted_run(tmp_path):
    def train(out: Path, *extra: str):
        args = ["train.py", "fit", "--config", "configs/vit_tiny_digits.yaml", "--trainer.accelerator", "cpu",
                "--model.model_overrides", TINY_VIT, "--trainer.max_epochs", "3", "--trainer.limit_train_batches", "4",
                "--trainer.limit_val_batches", "1", "--trainer.deterministic", "true",
                "--trainer.default_root_dir", str(out), *extra]
        return run_in_repo(args, env=PROBES, timeout=600)

    full = train(tmp_path / "full")
    assert full.returncode == 0, full.stderr[-2000:]
    killed = train(tmp_path / "killed", "--trainer.callbacks+=ddp_probe.KillAt", "--trainer.callbacks.epoch", "1",
                   "--trainer.callbacks.batch", "2")
    assert killed.returncode == -9  # SIGKILL: no handler ran
    assert not list((tmp_path / "killed/checkpoints").glob("*.tmp"))
    resumed = train(tmp_path / "killed", "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a = torch.load(tmp_path / "full/checkpoints/last.ckpt", weights_only=True)
    b = torch.load(tmp_path / "killed/checkpoints/last.ckpt", weights_only=True)
    assert (a["global_step"], a["epoch"]) == (b["global_step"], b["epoch"]) == (12, 2)
    for k, v in a["state_dict"].items():
        torch.testing.assert_close(b["state_dict"][k], v, atol=1e-5, rtol=1e-5, msg=k)


@pytest.mark.slow
def test_a_kill_during_a_checkpoint_write_leaves_the_previous_checkpoint_whole(tmp_path):
    args = ["train.py", "fit", "--config", "configs/vit_tiny_digits.yaml", "--trainer.accelerator", "cpu",
            "--model.model_overrides", TINY_VIT, "--trainer.max_epochs", "3", "--trainer.limit_train_batches", "2",
            "--trainer.limit_val_batches", "1", "--trainer.default_root_dir", str(tmp_path)]
    env = PROBES
    killed = run_in_repo([*args, "--trainer.callbacks+=ddp_probe.KillDuringSave", "--trainer.callbacks.step", "4"],
                         env=env, timeout=300)
    assert killed.returncode == -9
    last = tmp_path / "checkpoints/last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 2  # the checkpoint of epoch 0, whole
    torn = tmp_path / "checkpoints/last.ckpt.tmp"
    assert torn.exists() and torn.stat().st_size > 0  # the write that was cut short never replaced it
    with pytest.raises(Exception):  # noqa: B017 (whatever torch raises on half a file)
        torch.load(torn, weights_only=True)
    resumed = run_in_repo([*args, "--ckpt_path", "last"], env=env, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert torch.load(last, weights_only=True)["global_step"] == 6 and not torn.exists()


@pytest.mark.slow
def test_one_failing_ddp_rank_ends_the_whole_job(tmp_path):
    args = ["train.py", "fit", "--config", "configs/vit_tiny_digits.yaml", "--trainer.accelerator", "cpu",
            "--trainer.devices", "2", "--trainer.strategy", "ddp", "--trainer.max_epochs", "1",
            "--model.model_overrides", TINY_VIT, "--trainer.default_root_dir", str(tmp_path),
            "--trainer.callbacks+=ddp_probe.RaiseOnRank", "--trainer.callbacks.rank", "1",
            "--trainer.callbacks.step", "2"]
    # a hang in the next all-reduce would run into the timeout (subprocess.TimeoutExpired fails the test)
    out = run_in_repo(args, env=PROBES, timeout=300)
    assert out.returncode != 0
    assert "rank 1 fails on purpose at step 2" in out.stderr


@pytest.mark.parametrize("args, named", [
    (["--trainer.max_epochz", "3"], "max_epochz"),
    (["--trainer.max_epochs", "three"], "trainer.max_epochs"),
    (["--model.recipe.lr", "fast"], "error: --model.recipe.lr expects a float, got 'fast'"),
     # the flat flag's part
    (["--data.img_size", "[32"], "img_size"),
])
def test_config_mistakes_are_named_before_any_work(args, named, tmp_path):
    assert named in error_line_of(["train", "fit", "--config", str(ROOT / "configs/vit_tiny_digits.yaml"),
                                   *_cpu(tmp_path), *args])
    assert not (tmp_path / "checkpoints").exists()


def test_unknown_key_in_a_yaml_file_is_named(tmp_path):
    cfg = (ROOT / "configs/vit_tiny_digits.yaml").read_text()
    cfg = cfg.replace("      lr: 3.0e-3", "      lr: 3.0e-3\n      lr_peak: 1")
    (tmp_path / "bad.yaml").write_text(cfg)
    assert "lr_peak" in error_line_of(["train", "fit", "--config", str(tmp_path / "bad.yaml"), *_cpu(tmp_path)])


def test_unknown_model_override_is_named_before_training(tmp_path):
    line = error_line_of(["train", "fit", "--config", str(ROOT / "configs/vit_tiny_digits.yaml"), *_cpu(tmp_path),
                          "--model.model_overrides", '{"depht": 2}'])
    assert re.match(r"error: vit_tiny_patch16_224: unknown config field\(s\) \['depht'\]", line), line
    assert "Union" not in line
    assert not (tmp_path / "checkpoints").exists()


def test_image_folder_layout_errors_come_before_training(image_folder, tmp_path):
    from vitkit.lit import ImageFolderDataModule

    with pytest.raises(FileNotFoundError, match=r"'.*nowhere' does not exist or is not a folder; expected .*/train/"):
        ImageFolderDataModule(str(tmp_path / "nowhere"))
    root = tmp_path / "data"
    shutil.copytree(image_folder, root)
    shutil.rmtree(root / "val")
    with pytest.raises(FileNotFoundError, match=r"missing '.*val': expected .*/val/<class>/<images>"):
        ImageFolderDataModule(str(root))
    shutil.copytree(image_folder / "val", root / "val")
    (root / "train/class_3").mkdir()
    (root / "train/class_3/readme.txt").write_text("no images here")
    with pytest.raises(ValueError, match=r"class folder\(s\) without images in '.*train': \['class_3'\]"):
        ImageFolderDataModule(str(root))
    (root / "train/class_3/a.png").write_bytes((root / "train/class_0").glob("*.png").__next__().read_bytes())
    with pytest.raises(ValueError, match=r"differ .*only in train: \['class_3'\]; only in val: \[\]"):
        ImageFolderDataModule(str(root))


def test_a_sharded_save_killed_between_its_renames_is_settled_to_the_newest_whole_checkpoint(tmp_path):
    """The three places a save can be cut short: between the renames (no last.ckpt: the whole new one takes the
    name), after them (a leftover .old goes), before them (a .saving beside last.ckpt was never finished)."""
    from vitkit.training.strategies import settle_interrupted_saves

    def folder(name: str, step: int) -> None:
        (tmp_path / name).mkdir()
        (tmp_path / name / "step").write_text(str(step))

    folder("last.ckpt.old", 1)
    folder("last.ckpt.saving", 2)
    folder("best.ckpt", 1)
    folder("best.ckpt.old", 0)
    folder("epoch=3.ckpt", 3)
    folder("epoch=4.ckpt.saving", 4)
    settle_interrupted_saves(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.ckpt", "epoch=3.ckpt", "last.ckpt"]
    assert [(tmp_path / n / "step").read_text() for n in ("last.ckpt", "best.ckpt", "epoch=3.ckpt")] == ["2", "1", "3"]
    settle_interrupted_saves(tmp_path / "absent")  # a run that has not saved yet




def test_a_strategy_named_by_class_path_is_built_and_the_retired_fsdp1_one_is_refused_with_its_successor(tmp_path):
    base = ["--config", "vit_tiny_digits", "--trainer.default_root_dir", str(tmp_path), "--trainer.logger", "false"]
    cli = cli_main([*base, "--trainer.strategy", "vitkit.lit.strategies.FSDP2Strategy"], run=False)
    assert type(cli.trainer.strategy).__name__ == "FSDP2Strategy"
    with pytest.raises(ValueError, match="BlockFSDPStrategy .FSDP1. is retired; use FSDP2 in its place"):
        cli_main([*base, "--trainer.strategy", "vitkit.lit.strategies.BlockFSDPStrategy"], run=False)
    with pytest.raises(UsageError, match="expected a subclass of lightning's Strategy, got <module"):
        cli_main([*base, "--trainer.strategy", "os.path"], run=False)
