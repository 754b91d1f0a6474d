"""Two CPU processes under DDP: each rank draws its own random masks, a resumed run draws on every rank
what the uninterrupted run drew, a NaN loss on one rank is skipped by all, and a rank with no readable image
in its batch adds no gradient while the others make the step."""

import re
from pathlib import Path

import pytest
import torch

from .conftest import TINY_VIT, run_in_repo, run_in_turn

pytestmark = pytest.mark.slow


def _ddp(root: Path, *extra: str) -> list[str]:
    root.mkdir(parents=True, exist_ok=True)
    return ["fit", "--config", "configs/vit_tiny_digits.yaml", "--trainer.accelerator", "cpu", "--trainer.devices",
            "2", "--trainer.strategy", "ddp", "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches",
            "1", "--trainer.default_root_dir", str(root), "--model.model_overrides", TINY_VIT, *extra]


def _record(folder: Path) -> list[str]:
    return ["--trainer.callbacks+=ddp_probe.RecordRng", "--trainer.callbacks.out_dir", str(folder)]


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory, image_folder) -> tuple[Path, str]:
    """This file's three runs on two processes under DDP, one after another in one pair of processes (a hang
    fails the launch's timeout): two epochs uninterrupted (every epoch's checkpoint kept), the same run resumed
    from its first epoch's checkpoint, and one with a NaN loss and an unreadable batch (see the test below that
    reads it). Returns the folder and both ranks' stderr."""
    root = tmp_path_factory.mktemp("ddp")
    full = _ddp(root / "full", "--trainer.max_epochs", "2", "--trainer.callbacks.save_top_k", "-1",
                *_record(root / "full"))
    resumed = _ddp(root / "run", "--trainer.max_epochs", "2", "--ckpt_path",
                   f"glob:{root}/full/checkpoints/best-000-*.ckpt", *_record(root / "resumed"))
    faults = _ddp(root / "faults", "--trainer.max_epochs", "1", "--model.recipe.nonfinite_loss", "skip",
                  "--data", "vitkit.lit.ImageFolderDataModule", "--data.root", str(image_folder), "--data.img_size",
                  "32", "--data.batch_size", "4", "--data.num_workers", "0",
                  "--trainer.callbacks+=ddp_probe.UnreadableBatchOnRank", "--trainer.callbacks.rank", "1",
                  "--trainer.callbacks.batch", "0",
                  "--trainer.callbacks+=ddp_probe.NanLogitsOnce", "--trainer.callbacks.step", "1",
                  "--trainer.callbacks.rank", "0",
                  "--trainer.callbacks+=ddp_probe.RecordUpdates", "--trainer.callbacks.out_dir", str(root / "faults"))
    (root / "resumed").mkdir()
    done = run_in_turn([full, resumed, faults], root)
    return root, "".join(rank.stderr for rank in done)


def _draws(folder: Path, rank: int) -> dict[int, str]:
    """global step -> digest of the rank's generator state at the start of that step."""
    return dict(line.split() for line in (folder / f"rng{rank}.txt").read_text().splitlines())


@pytest.mark.timeout(900)
def test_ranks_draw_their_own_masks_and_a_resumed_run_draws_the_same(ddp_runs):
    """Two epochs uninterrupted (keeping every epoch's checkpoint), then a run resumed from the first epoch's
    checkpoint, as after an interruption there: each rank's generator is where the uninterrupted run had it."""
    root, _ = ddp_runs
    full = [_draws(root / "full", r) for r in (0, 1)]
    resumed = [_draws(root / "resumed", r) for r in (0, 1)]
    assert sorted(resumed[0]) == ["3", "4", "5"]  # the second epoch only
    for r in (0, 1):
        assert resumed[r] == {s: full[r][s] for s in resumed[r]}, f"rank {r} draws differently after the resume"
    assert all(full[0][s] != full[1][s] for s in full[0]), "both ranks drew the same masks"


@pytest.mark.timeout(900)
def test_a_nan_on_one_rank_is_skipped_by_all_and_an_empty_batch_adds_no_gradient(ddp_runs):
    """Rank 1 gets a batch whose files were all unreadable at step 0, rank 0 a NaN loss at step 1. Step 0 is made
    from rank 0's images alone; step 1 is skipped on both ranks (one all-reduce decides both), and the run ends
    instead of hanging in DDP's gradient all-reduce."""
    root, stderr = ddp_runs
    tmp_path = root / "faults"
    assert "skipping step 0" not in stderr
    for rank in (0, 1):  # step 0 changes the weights on both ranks alike, step 1 on neither
        assert (tmp_path / f"updates{rank}.txt").read_text().split("\n")[:2] == ["0 1", "1 0"]
    assert len(re.findall(r"skipping step 1: non-finite training loss nan$", stderr, re.M)) == 1  # rank 0
    assert stderr.count("skipping step 1: non-finite training loss nan/inf on another rank") == 1
    assert "train/skipped_files" in (tmp_path / "logs/version_0/metrics.csv").read_text()
    assert (tmp_path / "checkpoints/last.ckpt").exists()  # the run finished, no hang


@pytest.mark.timeout(600)
def test_the_vitkit_command_starts_every_rank_of_a_multi_process_run(tmp_path):
    """``vitkit train fit --trainer.devices 2``: Lightning starts rank 1 by running the command line again, which
    must still be the ``vitkit`` script followed by ``train``. The LR, given for a total batch (``lr_batch``),
    follows the run's: 2 processes x batch 32 x 2 accumulated batches, 4 times the recipe's 3e-3 for 32, said at the
    start and what the optimizer ran."""
    import shutil
    import sys

    script = shutil.which("vitkit", path=str(Path(sys.executable).parent))
    assert script, "the vitkit console script is not installed beside this Python"
    out = run_in_repo([script, "train", "fit", "--config=vit_tiny_digits", "--trainer.accelerator=cpu",
                       "--trainer.devices=2", "--trainer.strategy=ddp", "--trainer.max_epochs=1",
                       "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1", "--trainer.logger=false",
                       "--trainer.accumulate_grad_batches=2", "--model.recipe.lr_batch=32",
                       f"--trainer.default_root_dir={tmp_path}", f"--model.model_overrides={TINY_VIT}"], timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "MEMBER: 2/2" in out.stderr and (tmp_path / "checkpoints/last.ckpt").exists()
    said = out.stdout + out.stderr
    assert ("lr: 0.003 for a total batch of 32; this run's is 128 (2 process(es) x batch 32 x 2 accumulated): lr "
            "0.012 (x 128/32)") in said, said[-3000:]
    saved = torch.load(tmp_path / "checkpoints/last.ckpt", weights_only=True, map_location="cpu")
    assert saved["lr_schedulers"][0]["base_lrs"] == [pytest.approx(0.012)] * len(saved["lr_schedulers"][0]["base_lrs"])
    assert saved["hyper_parameters"]["recipe"]["lr"] == 0.003  # the recipe as given: a resumed run scales it again
