"""Streaming shards: the conversion round trip, its resume and refusals, the same transforms as ImageFolder,
every sample once per epoch under 2-process DDP with workers, and a SIGKILLed run resumed mid-epoch at the
next batch, ending with the uninterrupted run's weights."""

import json
import os
import re
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests import forkserver
from vitkit.data.shards import MARKER, prepare_data, read_dataset_info

from ..commands import error_line_of
from .conftest import N_TRAIN, N_VAL, PROBES, TINY_VIT, launch, run_in_repo


def test_conversion_keeps_the_original_bytes_labels_and_names_and_leaves_out_bad_files(id_folder, shards):
    from litdata import StreamingDataset

    info = read_dataset_info(str(shards))
    assert info["classes"] == ["class_0", "class_1", "class_2"]
    assert info["splits"] == {"train": {"samples": N_TRAIN, "skipped": 2}, "val": {"samples": N_VAL + 1, "skipped": 0}}
    skipped = (shards / "train.skipped.tsv").read_text()
    assert "train/class_0/broken.jpg\tUnidentifiedImageError" in skipped and "train/class_1/truncated.png" in skipped
    assert len(list((shards / "train").glob("chunk-*.bin"))) > 2  # several shards, written by two workers
    for split in ("train", "val"):
        ds = StreamingDataset(str(shards / split))
        samples = [ds[i] for i in range(len(ds))]
        assert sorted(s["path"] for s in samples) == sorted(
            str(p.relative_to(id_folder)) for p in (id_folder / split).rglob("*.*")
            if p.name not in ("broken.jpg", "truncated.png"))
        for s in samples:
            assert s["image"] == (id_folder / s["path"]).read_bytes()  # not re-encoded
            assert s["class_name"] == Path(s["path"]).parent.name == info["classes"][s["label"]]


def test_an_interrupted_conversion_resumes_and_a_finished_or_foreign_one_is_refused(id_folder, shards, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(shards, out)
    with pytest.raises(FileExistsError, match="already holds a complete converted dataset"):
        prepare_data(id_folder, out, workers=2)
    # as if stopped while converting val: its chunks half there, no index, no marker
    (out / MARKER).unlink()
    (out / "val/index.json").unlink()
    for chunk in sorted((out / "val").glob("chunk-*.bin"))[1:]:
        chunk.unlink()
    with pytest.raises(FileNotFoundError, match="is an unfinished conversion .* again to finish it"):
        read_dataset_info(str(out))
    train_before = {p.name: p.read_bytes() for p in (out / "train").iterdir() if p.is_file()}
    summary = prepare_data(id_folder, out, workers=2)
    assert summary["splits"]["val"] == {"samples": N_VAL + 1, "skipped": 0}
    assert {p.name: p.read_bytes() for p in (out / "train").iterdir() if p.is_file()} == train_before  # kept as it was
    assert read_dataset_info(str(out)) == read_dataset_info(str(shards))
    # an unfinished conversion of other files, or a folder that prepare-data did not start
    (out / MARKER).unlink()
    (id_folder / "val/class_1/new.png").write_bytes((id_folder / "val/class_1/100.png").read_bytes())
    try:
        with pytest.raises(FileExistsError, match="unfinished conversion of other files"):
            prepare_data(id_folder, out)
    finally:
        (id_folder / "val/class_1/new.png").unlink()
    (tmp_path / "other").mkdir()
    (tmp_path / "other/notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty and was not started by prepare-data"):
        prepare_data(id_folder, tmp_path / "other")
    assert (tmp_path / "other/notes.txt").read_text() == "mine"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_prepare_data_killed_mid_split_resumes_to_the_same_dataset(tmp_path):
    """SIGKILL the command (and its workers) while it works through a split, run it again: every file once, none
    twice. Three large images at the end of the split (about 1 s each to decode) keep it busy after the first
    shards of the small ones are written."""
    from litdata import StreamingDataset

    root = tmp_path / "root"
    rng = np.random.default_rng(0)
    for split, n in (("train", 40), ("val", 4)):
        for i in range(n):
            (root / split / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(root / split / f"c{i % 2}/{i}.png")
    big = root / "train/c1/zz0.png"
    Image.new("RGB", (8000, 8000), (10, 20, 30)).save(big)
    for k in (1, 2):
        shutil.copyfile(big, root / f"train/c1/zz{k}.png")
    proc = forkserver.popen(["-m", "vitkit.cli", "prepare-data", str(root), str(tmp_path / "out"), "--workers", "1",
                             "--chunk-bytes", "4KB"], cwd=tmp_path, new_group=True)  # its own process group
    deadline = time.time() + 120
    while len(list((tmp_path / "out/train").glob("chunk-*.bin"))) < 5 and time.time() < deadline:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)  # the command and its litdata workers
    proc.wait()
    assert not (tmp_path / "out/train/index.json").exists(), "the conversion finished before it could be killed"
    with pytest.raises(FileNotFoundError, match="unfinished conversion"):
        read_dataset_info(str(tmp_path / "out"))
    summary = prepare_data(root, tmp_path / "out")  # the same command again (in this process: quicker)
    assert summary["splits"]["train"] == {"samples": 43, "skipped": 0}
    ds = StreamingDataset(str(tmp_path / "out/train"))
    paths = [ds[i]["path"] for i in range(len(ds))]
    assert sorted(paths) == sorted(str(p.relative_to(root)) for p in (root / "train").rglob("*.png"))


def test_prepare_data_command_names_what_is_wrong(id_folder, tmp_path, capsys):

    assert re.search("does not exist or is not a folder",
                     error_line_of(["prepare-data", str(tmp_path / "nowhere"), str(tmp_path / "out")]))
    (tmp_path / "half").mkdir()
    (tmp_path / "half/.vitkit_inputs.json").write_text("{}")
    from vitkit.lit import StreamingImageDataModule

    with pytest.raises(FileNotFoundError, match="unfinished conversion"):
        StreamingImageDataModule(str(tmp_path / "half"))
    with pytest.raises(FileNotFoundError, match="not a converted dataset .* an image folder: convert it with `vitkit"):
        StreamingImageDataModule(str(id_folder))


def _by_id(samples, cfg) -> dict[int, torch.Tensor]:
    """Image tensors keyed by the id their colour encodes."""
    out = {}
    for x, _ in samples:
        rgb = x[:, 0, 0] * torch.tensor(cfg.std) + torch.tensor(cfg.mean)
        r, g = (rgb[:2] * 255).round().long().tolist()
        out[r // 4 + 64 * (g // 4)] = x
    return out


def test_streaming_module_transforms_and_normalises_as_image_folder(id_folder, shards, tmp_path):
    from vitkit.lit import ImageFolderDataModule, StreamingImageDataModule

    kw = dict(img_size=16, batch_size=4, num_workers=0, model_name="vit_tiny_patch16_224")
    stream, folder = StreamingImageDataModule(str(shards), **kw), ImageFolderDataModule(str(id_folder), **kw)
    assert stream.classes == folder.classes and stream.num_classes == 3
    assert vars(stream.data_cfg) == vars(folder.data_cfg)
    stream.setup("fit")
    folder.setup("fit")
    assert repr(stream.train_set.image_transform) == repr(folder.train_set.folder.transform)
    a = _by_id(stream.val_set, stream.data_cfg)
    b = _by_id((s for s in folder.val_set if s is not None), folder.data_cfg)
    assert sorted(a) == sorted(b) and len(a) == N_VAL + 1
    for i in a:
        torch.testing.assert_close(a[i], b[i], atol=0, rtol=0)
    # a sample damaged after conversion is skipped and counted, like an unreadable file
    damaged = tmp_path / "damaged"
    shutil.copytree(shards, damaged)
    png = (id_folder / "val/class_1/100.png").read_bytes()
    chunk = next(p for p in (damaged / "val").glob("chunk-*.bin") if png in p.read_bytes())
    data = chunk.read_bytes()
    start = data.index(png) + 40  # keep the PNG header, zero its image data
    chunk.write_bytes(data[:start] + bytes(len(png) - 60) + data[start + len(png) - 60:])
    dm = StreamingImageDataModule(str(damaged), **kw)
    dm.setup("fit")
    batches = list(dm.val_dataloader())
    assert sum(b[2] for b in batches) == 1 and sum(len(b[1]) for b in batches) == N_VAL


def _fit(root: Path, shards: Path, *extra: str, devices: int = 1, timeout: int = 300):
    """The training command on one process, or on ``devices`` processes started as a launcher starts them (each
    rank a child of the tests' prepared interpreter): their CompletedProcess, or a list of them."""
    args = ["train.py", "fit", "--config", "configs/vit_tiny_digits.yaml", "--trainer.accelerator", "cpu",
            "--trainer.devices", str(devices), "--trainer.default_root_dir", str(root), "--trainer.logger", "false",
            "--trainer.enable_progress_bar", "false", "--trainer.limit_val_batches", "0",  # training alone
            "--data", "vitkit.lit.StreamingImageDataModule", "--data.root", str(shards), "--data.img_size", "16",
            "--data.batch_size", "4", "--data.num_workers", "2", *extra]
    if devices > 1:
        return launch(args, 1, devices, env=PROBES, timeout=timeout)
    return run_in_repo(args, env=PROBES, timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("packing", [False, True], ids=["batched", "packed"])
def test_two_ddp_ranks_with_workers_read_every_sample_once_per_epoch_also_across_a_kill(shards, tmp_path, packing):
    """75 samples, batch 4, 2 workers per rank: 10 batches per rank per epoch (one rank has fewer samples and
    ends with an empty batch). Killed in the second epoch at batch 7, resumed from last.ckpt at step 16 (after
    its batch 5): each rank goes on with batch 6, holding the samples it held before the kill. The same with
    each batch packed (``--data.packing``: each image at its own crop's shape within 4 patches, 4 to a sequence)."""
    packed = ["--data.packing", "true", "--data.max_tokens", "20"] if packing else []
    args = ["--trainer.strategy", "ddp", "--trainer.max_epochs", "2", "--model.model_overrides", TINY_VIT,
            "--data.auto_augment", "null", "--data.re_prob", "0", "--data.color_jitter", "null", *packed,
            "--trainer.callbacks.last_every_n_train_steps", "4",
            "--trainer.callbacks+=ddp_probe.RecordIds", "--trainer.callbacks.out_dir"]
    kill = ["--trainer.callbacks+=ddp_probe.KillAt", "--trainer.callbacks.epoch", "1", "--trainer.callbacks.batch", "7"]
    for run in ("killed", "resumed"):
        (tmp_path / run).mkdir()
    killed = _fit(tmp_path, shards, *args, str(tmp_path / "killed"), *kill, devices=2)
    assert [rank.returncode for rank in killed] == [-signal.SIGKILL] * 2, [r.stderr[-2000:] for r in killed]
    resumed = _fit(tmp_path, shards, *args, str(tmp_path / "resumed"), "--ckpt_path", "last", devices=2)
    for rank in resumed:
        assert rank.returncode == 0, rank.stderr[-3000:]

    def batches(run: str, rank: int) -> dict[tuple[int, int], list[int]]:
        out: dict[tuple[int, int], list[int]] = {}
        for line in (tmp_path / run / f"ids{rank}.txt").read_text().splitlines():
            epoch, batch, i = map(int, line.split())
            out.setdefault((epoch, batch), []).append(i)
        return out

    for rank in (0, 1):
        before, after = batches("killed", rank), batches("resumed", rank)
        assert min(after) == (1, 6), f"rank {rank} did not continue at the batch after the checkpoint"
        for batch in (6, 7):  # read before the kill, and again after the resume
            assert after[1, batch] == before[1, batch], f"rank {rank}: batch {batch} holds other samples after resuming"
    runs = [{**batches("killed", r), **batches("resumed", r)} for r in (0, 1)]
    assert sorted(map(len, runs)) == [18, 20]  # 10 batches per epoch; one rank's last is empty (nothing recorded)
    for epoch in (0, 1):
        ids = [i for run in runs for (e, _), b in run.items() if e == epoch for i in b]
        assert sorted(ids) == list(range(N_TRAIN)), f"epoch {epoch}: not every sample exactly once"
    order = [[i for (e, _), b in sorted(runs[0].items()) if e == epoch for i in b] for epoch in (0, 1)]
    assert order[0] != order[1], "the second epoch was not shuffled anew"
    assert all((tmp_path / run / f"packed{rank}.txt").exists() == packing for run in ("killed", "resumed")
               for rank in (0, 1))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigkill_mid_epoch_then_resume_continues_at_the_next_batch(shards, tmp_path):
    """Augmentation, drop path and mixup on, 2 workers, last.ckpt every 5 steps (19 steps per epoch): killed in
    the second epoch at its 9th batch, resumed from step 25 (6 batches into that epoch)."""
    overrides = json.dumps({**json.loads(TINY_VIT), "drop_path_rate": 0.2})
    common = ["--trainer.max_epochs", "2", "--model.model_overrides", overrides, "--model.labels.mixup", "0.5",
              "--trainer.callbacks.last_every_n_train_steps", "5"]
    with ThreadPoolExecutor(2) as pool:  # the uninterrupted run and the one to be killed, side by side
        full = pool.submit(_fit, tmp_path / "full", shards, *common)
        killed = _fit(tmp_path / "killed", shards, *common, "--trainer.callbacks+=ddp_probe.KillAt",
                      "--trainer.callbacks.epoch", "1", "--trainer.callbacks.batch", "8")
        full = full.result()
    assert full.returncode == 0, full.stderr[-3000:]
    assert killed.returncode == -9, killed.stderr[-3000:]
    mid = torch.load(tmp_path / "killed/checkpoints/last.ckpt", weights_only=False)
    assert (mid["global_step"], mid["epoch"]) == (25, 1)
    resumed = _fit(tmp_path / "killed", shards, *common, "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a = torch.load(tmp_path / "full/checkpoints/last.ckpt", weights_only=False)
    b = torch.load(tmp_path / "killed/checkpoints/last.ckpt", weights_only=False)
    assert (a["global_step"], a["epoch"]) == (b["global_step"], b["epoch"]) == (38, 1)
    for k, v in a["state_dict"].items():
        torch.testing.assert_close(b["state_dict"][k], v, atol=1e-5, rtol=1e-5, msg=k)


def test_the_image_data_modules_share_one_definition_of_their_arguments():
    """Loader sizes, augmentation and preprocessing are defined once (the shared base) and reach the CLI of both
    image DataModules with the same types and defaults, beside each module's own arguments."""
    import inspect

    from jsonargparse import ArgumentParser

    from vitkit.data.modules.images import SkippingImages
    from vitkit.lit import ImageFolderDataModule, StreamingImageDataModule

    shared = [p for p in inspect.signature(SkippingImages.__init__).parameters.values() if p.name != "self"]
    assert {"img_size", "auto_augment", "re_prob", "scale", "hflip", "color_jitter", "mean", "std"} <= {
        p.name for p in shared}
    for cls, own in ((ImageFolderDataModule, "train_dir"), (StreamingImageDataModule, "max_cache_size")):
        parser = ArgumentParser()
        parser.add_class_arguments(cls, "data")
        defaults = parser.get_defaults().data
        assert own in defaults
        for p in shared:
            assert defaults[p.name] == p.default, (cls.__name__, p.name)


def _first_pixel(img) -> torch.Tensor:  # at module level: loader workers pickle the transform
    return torch.tensor(img.getpixel((0, 0)))


@pytest.mark.parametrize("batch_size,num_workers", [(4, 0), (4, 2), (5, 3), (32, 2)])
def test_the_batch_count_of_an_epoch_is_what_litdata_yields(shards, batch_size, num_workers):
    """``batches_per_rank`` (computed from the sizes, without litdata's internals) equals the batches litdata's
    loader yields; an epoch left after one batch is followed by a whole one, with every sample once."""
    from functools import partial

    from litdata import StreamingDataLoader

    from vitkit.data.folder import collate_skipping
    from vitkit.data.streaming import EvenBatches, ImageShards, batches_per_rank

    make = partial(StreamingDataLoader, ImageShards(str(shards / "train"), _first_pixel, shuffle=True),
                   batch_size=batch_size, num_workers=num_workers, collate_fn=collate_skipping)
    yielded = sum(1 for _ in make())
    assert batches_per_rank(N_TRAIN, 1, num_workers, batch_size) == [yielded]
    even = EvenBatches(make, N_TRAIN)
    assert len(even) == even.real == yielded
    next(iter(even))  # leave the first epoch after one batch
    pixels = torch.cat([x for x, _, _ in even])  # the next epoch, whole
    ids = (pixels[:, 0] - 2) // 4 + 64 * ((pixels[:, 1] - 2) // 4)  # see conftest._solid
    assert even.batches == yielded and sorted(ids.tolist()) == list(range(N_TRAIN))
