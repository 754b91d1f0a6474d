"""Hugging Face datasets: every way a user holds one (a hub name from the cache, a save_to_disk folder, a folder of
images, parquet, arrow and webdataset files) gives the folder module's samples in its transforms; columns, splits
and bad input fail in one line; offline, a missing dataset names the command that fetches it; under DDP each rank
reads its part and a resumed run ends where the uninterrupted one did; a stream makes the same number of steps on
every rank, reads every sample once per epoch, and a killed stream resumes from its saved state."""

import io
import json
import shutil
import tarfile
from pathlib import Path

import datasets
import pytest
import torch
from PIL import Image

from tests.commands import one_error_line, run_cli
from vitkit.lit import HFDataModule, ImageFolderDataModule

from .conftest import N_TRAIN, N_VAL, PROBES, TINY_VIT, _solid, run_in_repo, run_in_turn
from .test_streaming import _by_id

KW = dict(img_size=16, batch_size=4, num_workers=0, model_name="vit_tiny_patch16_224")
FORMATS = ["hub cache", "save_to_disk", "image folder", "parquet", "arrow", "webdataset"]


def _hub_cache(ds: datasets.DatasetDict, cache: Path, name: str) -> None:
    """``ds`` in the datasets cache as the hub dataset ``name`` (what ``vitkit download --dataset`` leaves)."""
    tmp = cache / "tmp"
    for split, part in ds.items():
        part.to_parquet(str(tmp / f"{split}.parquet"))
    datasets.load_dataset("parquet", data_files={s: str(tmp / f"{s}.parquet") for s in ds}, cache_dir=str(tmp))
    built = next(p for p in (tmp / "parquet").glob("*/*/*") if p.is_dir())
    dest = cache / name.replace("/", "___") / "default" / built.parent.name / built.name
    shutil.copytree(built, dest)
    for f in dest.glob("parquet-*"):
        f.rename(f.with_name(f.name.replace("parquet-", name.split("/")[-1] + "-")))
    shutil.rmtree(tmp)


def _webdataset(ds: datasets.Dataset, tar: Path) -> None:
    """One ``NNNNN.png`` / ``NNNNN.cls`` pair per row (webdataset's keys share one type: a JPEG is stored as the
    PNG of its pixels; a broken file as its bytes)."""
    with tarfile.open(tar, "w") as out:
        for i, row in enumerate(ds.cast_column("image", datasets.Image(decode=False))):
            data = row["image"]["bytes"] or Path(row["image"]["path"]).read_bytes()
            if not data.startswith(b"\x89PNG"):
                try:
                    buf = io.BytesIO()
                    Image.open(io.BytesIO(data)).convert("RGB").save(buf, "PNG")
                    data = buf.getvalue()
                except OSError:
                    pass
            for suffix, blob in (("png", data), ("cls", str(row["label"]).encode())):
                info = tarfile.TarInfo(f"{i:05d}.{suffix}")
                info.size = len(blob)
                out.addfile(info, io.BytesIO(blob))


@pytest.fixture(scope="module")
def sources(id_folder, tmp_path_factory) -> dict[str, dict]:
    """The streaming tests' folder of solid images (ids in their colours, two broken files in train) in every
    form, as the arguments of HFDataModule that open it; and the hub cache's folder."""
    root = tmp_path_factory.mktemp("hf")
    folder = datasets.load_dataset(str(id_folder))  # imagefolder: train and validation, labels by folder
    embedded = datasets.DatasetDict({k: v.cast_column("image", datasets.Image()) for k, v in folder.items()})
    embedded.save_to_disk(str(root / "saved"))
    for split, part in embedded.items():
        part.to_parquet(str(root / f"{split}.parquet"))
    arrow = {s: sorted(str(p) for p in (root / "saved" / s).glob("*.arrow")) for s in embedded}
    for split, part in embedded.items():
        _webdataset(part, root / f"{split}.tar")
    _hub_cache(embedded, root / "cache", "vitkit/ids")
    uneven = []  # train in 4 files of very different sizes: streamed, one file per rank and worker
    for k, (a, b) in enumerate([(0, 36), (36, 66), (66, 72), (72, 77)]):
        embedded["train"].select(range(a, b)).to_parquet(str(root / f"part{k}.parquet"))
        uneven.append(str(root / f"part{k}.parquet"))
    return {"cache": root / "cache", "hub cache": dict(name="vitkit/ids"),
            "save_to_disk": dict(name=str(root / "saved")), "image folder": dict(name=str(id_folder)),
            "parquet": dict(data_files={s: str(root / f"{s}.parquet") for s in embedded}),
            "arrow": dict(data_files=arrow),
            "uneven": dict(data_files={"train": uneven, "validation": str(root / "validation.parquet")}),
            "webdataset": dict(data_files={s: str(root / f"{s}.tar") for s in embedded}, label_column="cls")}


@pytest.fixture
def cache(sources, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(sources["cache"]))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(sources["cache"]))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # not one network call
    return sources["cache"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", FORMATS)
def test_every_form_gives_the_folder_modules_samples_in_its_transforms(kind, sources, cache, id_folder):
    dm, folder = HFDataModule(**sources[kind], **KW), ImageFolderDataModule(str(id_folder), **KW)
    dm.setup("fit")
    folder.setup("fit")
    if kind == "webdataset":  # integer labels: the classes are their numbers
        assert dm.classes == ["0", "1", "2"]
    else:
        assert dm.classes == folder.classes == ["class_0", "class_1", "class_2"]
    assert vars(dm.data_cfg) == vars(folder.data_cfg)
    assert repr(dm.train_set.transform) == repr(folder.train_set.folder.transform)
    assert len(dm.train_set) == N_TRAIN + 2  # the two broken files are rows too
    a = _by_id([s for s in dm.val_set if s is not None], dm.data_cfg)
    b = _by_id([s for s in folder.val_set if s is not None], folder.data_cfg)
    assert sorted(a) == sorted(b) and len(a) == N_VAL + 1
    for i in a:
        torch.testing.assert_close(a[i], b[i], atol=0, rtol=0)
    labels = {i: y for i, y in enumerate(s[1] for s in dm.val_set if s is not None)}
    assert sorted(set(labels.values())) == [0, 1, 2]
    # the broken rows are skipped (and counted by the module, as unreadable files are)
    assert sum(s is None for s in dm.train_set) == 2
    batch = dm.on_after_batch_transfer(next(iter(dm.train_dataloader())), 0)
    assert batch[0].shape[1:] == (3, 16, 16) and dm.seen["val"] + dm.skipped["val"] == 4


def test_a_string_label_column_maps_to_sorted_class_names_and_a_split_is_carved_by_seed(tmp_path):
    names = ["zebra", "ant", "moth"]
    rows = {"img": [], "kind": []}
    for i in range(30):
        buf = io.BytesIO()
        _solid(i).save(buf, "PNG")
        rows["img"].append({"bytes": buf.getvalue(), "path": None})
        rows["kind"].append(names[i % 3])
    ds = datasets.Dataset.from_dict(rows, features=datasets.Features({"img": datasets.Image(),
                                                                      "kind": datasets.Value("string")}))
    ds.to_parquet(str(tmp_path / "train.parquet"))
    plain = dict(auto_augment=None, color_jitter=None, re_prob=0.0)  # solid images keep their colour: their id
    make = lambda **kw: HFDataModule(data_files=str(tmp_path / "train.parquet"), label_column="kind",
                                     val_fraction=0.2, **{**KW, **plain, **kw})
    dm = make()
    assert dm.classes == ["ant", "moth", "zebra"] and dm.image_column == "img"
    dm.setup("fit")
    again, other = make(), make(seed=1)
    again.setup("fit")
    other.setup("fit")
    ids = lambda s: sorted(_by_id([x for x in s if x is not None], dm.data_cfg))
    assert len(ids(dm.val_set)) == 6 and len(ids(dm.train_set)) == 24
    assert not set(ids(dm.val_set)) & set(ids(dm.train_set))
    assert ids(again.val_set) == ids(dm.val_set) != ids(other.val_set)  # the same on every rank and run
    for x, y in dm.val_set:
        i = _by_id([(x, y)], dm.data_cfg).popitem()[0]
        assert dm.classes[y] == names[i % 3]


@pytest.fixture(scope="module")
def bad_sets(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bad")
    buf = io.BytesIO()
    _solid(1).save(buf, "PNG")
    img = {"bytes": buf.getvalue(), "path": None}
    two = datasets.Features({"a": datasets.Image(), "b": datasets.Image(), "label": datasets.ClassLabel(names=["x"])})
    datasets.Dataset.from_dict({"a": [img] * 4, "b": [img] * 4, "label": [0] * 4}, features=two).to_parquet(
        str(root / "two_images.parquet"))
    datasets.Dataset.from_dict({"text": ["a b", "c d"], "label": [0, 1]}, features=datasets.Features(
        {"text": datasets.Value("string"), "label": datasets.ClassLabel(names=["neg", "pos"])})).to_parquet(
        str(root / "text.parquet"))
    datasets.Dataset.from_dict({"image": [img] * 4, "score": [0.5] * 4}, features=datasets.Features(
        {"image": datasets.Image(), "score": datasets.Value("float32")})).to_parquet(str(root / "floats.parquet"))
    datasets.Dataset.from_dict({"image": [], "label": []}, features=datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=["x"])})).to_parquet(str(root / "empty.parquet"))
    return root


@pytest.mark.slow
@pytest.mark.parametrize("args, says", [
    (["--data.data_files", "{root}/two_images.parquet"],
     "has 2 image column(s), expected one; its columns are a (Image), b (Image), label (ClassLabel, 1 classes)"),
    (["--data.data_files", "{root}/text.parquet"],
     "has no image column(s), expected one; its columns are text (string)"),
    (["--data.data_files", "{root}/floats.parquet", "--data.label_column", "score"],
     "--data.label_column 'score' is float32, not a label"),
    (["--data.data_files", "{root}/floats.parquet"], "has no ClassLabel column(s), expected one"),
    (["--data.data_files", "{root}/empty.parquet"], "empty.parquet has no rows"),
    (["--data.data_files", "{root}/two_images.parquet", "--data.image_column", "a", "--data.train_split", "training"],
     "has no split 'training' (--data.train_split); its splits are train"),
    (["--data.name", "vitkit/not-cached"], "dataset 'vitkit/not-cached' is not in the datasets cache ("),
])
def test_bad_data_is_refused_in_one_line_and_nothing_is_written(args, says, bad_sets, cache, tmp_path, capfd):
    argv = ["train", "fit", "-c", "vit_tiny_digits", "--data", "vitkit.lit.HFDataModule",
            *[a.format(root=bad_sets) for a in args], "--trainer.default_root_dir", str(tmp_path / "run")]
    line = one_error_line(*run_cli(argv, capfd))
    assert says in line, line
    if "not-cached" in args[-1]:
        assert str(cache) in line and "vitkit download --dataset vitkit/not-cached" in line
        assert line.endswith("or give a local folder or --data.data_files"), line
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_prepare_data_names_a_dataset_not_in_the_cache_with_its_own_alternative(cache, tmp_path, capfd):
    line = one_error_line(*run_cli(["prepare-data", "hf:vitkit/not-cached", str(tmp_path / "shards")], capfd))
    assert "dataset 'vitkit/not-cached' is not in the datasets cache (" in line and str(cache) in line, line
    assert line.endswith("or give a folder written by save_to_disk as the root") and "--data." not in line, line


@pytest.mark.slow
def test_download_names_a_dataset_it_cannot_fetch_in_one_line(cache, capfd):
    code, err = run_cli(["download", "--dataset", "vitkit/not-cached"], capfd)
    assert code == 1 and err.strip().startswith("vitkit/not-cached: error:"), err


# -- several ranks -------------------------------------------------------------------------------------------


def _hf_run(root: Path, source: dict, *extra: str) -> list[str]:
    data = [f"--data.{k}={json.dumps(v) if isinstance(v, dict) else v}" for k, v in source.items()]
    return ["fit", "--config", "configs/vit_tiny_digits.yaml", "--trainer.accelerator", "cpu",
            "--trainer.default_root_dir", str(root), "--trainer.logger", "false", "--trainer.enable_progress_bar",
            "false", "--model.model_overrides", TINY_VIT, "--data", "vitkit.lit.HFDataModule", *data,
            "--data.img_size", "16", "--data.batch_size", "4", "--data.auto_augment", "null", "--data.re_prob", "0",
            "--data.color_jitter", "null", *extra, "--trainer.callbacks+=ddp_probe.RecordIds",
            "--trainer.callbacks.out_dir", str(root)]


def _ids(root: Path, rank: int) -> dict[tuple[int, int], list[int]]:
    out: dict[tuple[int, int], list[int]] = {}
    for line in (root / f"ids{rank}.txt").read_text().splitlines():
        epoch, batch, i = map(int, line.split())
        out.setdefault((epoch, batch), []).append(i)
    return out


@pytest.fixture(scope="module")
def ddp_runs(sources, tmp_path_factory) -> Path:
    """On two processes under DDP, one after another: the map-style parquet files for two epochs (every epoch's
    checkpoint kept), the same resumed from its first epoch's checkpoint, and train streamed from 4 files of 36, 30,
    6 and 5 rows with 2 loader workers per rank for two epochs."""
    root = tmp_path_factory.mktemp("hfddp")
    ddp = ["--trainer.devices", "2", "--trainer.strategy", "ddp", "--trainer.limit_val_batches", "1",
           "--trainer.max_epochs", "2", "--data.num_workers", "0"]
    full = _hf_run(root / "full", sources["parquet"], *ddp, "--trainer.callbacks.save_top_k", "-1")
    resumed = _hf_run(root / "resumed", sources["parquet"], *ddp, "--ckpt_path",
                      f"glob:{root}/full/checkpoints/best-000-*.ckpt")
    stream = _hf_run(root / "stream", sources["uneven"], *ddp[:-2], "--data.num_workers", "2",
                     "--data.streaming", "true", "--trainer.max_steps", "1000")  # the schedule's length
    for run in ("full", "resumed", "stream"):
        (root / run).mkdir()
    run_in_turn([full, resumed, stream], root)
    return root


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_map_style_ranks_read_their_parts_and_a_resumed_run_ends_with_the_same_weights(ddp_runs):
    full = [_ids(ddp_runs / "full", r) for r in (0, 1)]
    for epoch in (0, 1):
        # 77 rows padded to 39 per rank, 9 whole batches of 4 each; the broken rows are skipped
        ids = [i for rank in full for (e, _), b in rank.items() if e == epoch for i in b]
        assert 2 * 9 * 4 - 2 <= len(ids) <= 2 * 9 * 4 and set(ids) <= set(range(N_TRAIN))
        assert len(set(ids)) >= len(ids) - 1, f"epoch {epoch}: the ranks did not read disjoint parts"
    resumed = [_ids(ddp_runs / "resumed", r) for r in (0, 1)]
    for r in (0, 1):
        assert {k: v for k, v in full[r].items() if k[0] == 1} == resumed[r], f"rank {r} read otherwise after resuming"
    a = torch.load(ddp_runs / "full/checkpoints/last.ckpt", weights_only=False)["state_dict"]
    b = torch.load(ddp_runs / "resumed/checkpoints/last.ckpt", weights_only=False)["state_dict"]
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-6, rtol=1e-6, msg=k)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_stream_makes_the_same_steps_on_every_rank_and_reads_every_row_once_per_epoch(ddp_runs):
    """Each rank streams 2 of the 4 files, one per loader worker, in batches of 4: their batch counts differ, and
    the shorter rank trains on empty batches until both end (the run ending at all shows that no rank waited on a
    collective the other never reached: a hang fails the launch's timeout)."""
    ranks = [_ids(ddp_runs / "stream", r) for r in (0, 1)]
    for epoch in (0, 1):
        ids = [i for rank in ranks for (e, _), b in rank.items() if e == epoch for i in b]
        assert sorted(ids) == list(range(N_TRAIN)), f"epoch {epoch}: not every readable row exactly once"
        per_rank = [{i for (e, _), b in rank.items() if e == epoch for i in b} for rank in ranks]
        assert not per_rank[0] & per_rank[1]
        batches = [len({b for e, b in rank if e == epoch}) for rank in ranks]  # empty batches record nothing
        assert batches[0] != batches[1], batches
    order = [[i for (e, _), b in sorted(ranks[0].items()) if e == epoch for i in b] for epoch in (0, 1)]
    assert order[0] != order[1], "the second epoch was not shuffled anew"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_stream_resumes_from_its_saved_state(sources, tmp_path):
    """One process, 2 loader workers, a shuffle buffer of 8, last.ckpt every 5 steps (20 steps per epoch): killed in
    the second epoch at its 9th batch, resumed from step 25. The stream goes on from the position it saved: no row
    of the epoch comes twice. The rows that sat in the shuffle buffers when it was saved are not in the checkpoint
    (the datasets library refills the buffer): at most the buffers' size is missing from that epoch."""
    common = ["--trainer.max_epochs", "2", "--trainer.limit_val_batches", "1", "--data.num_workers", "2",
              "--data.streaming", "true", "--data.shuffle_buffer", "8", "--trainer.max_steps", "1000",
              "--trainer.callbacks.last_every_n_train_steps", "5"]
    killed = run_in_repo(["train.py", *_hf_run(tmp_path, sources["save_to_disk"], *common,
                                               "--trainer.callbacks+=ddp_probe.KillAt", "--trainer.callbacks.epoch",
                                               "1", "--trainer.callbacks.batch", "8")], env=PROBES, timeout=300)
    assert killed.returncode == -9, killed.stderr[-3000:]
    mid = torch.load(tmp_path / "checkpoints/last.ckpt", weights_only=False)
    assert (mid["global_step"], mid["epoch"]) == (25, 1)
    before = _ids(tmp_path, 0)
    assert sorted(i for (e, _), ids in before.items() if e == 0 for i in ids) == list(range(N_TRAIN))
    (tmp_path / "ids0.txt").rename(tmp_path / "before.txt")
    resumed = run_in_repo(["train.py", *_hf_run(tmp_path, sources["save_to_disk"], *common, "--ckpt_path", "last")],
                          env=PROBES, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = _ids(tmp_path, 0)
    assert min(after) == (1, 5), "the resumed run did not continue at the batch after the checkpoint"
    epoch1 = [i for (e, b), ids in before.items() if e == 1 and b < 5 for i in ids] + \
        [i for (e, _), ids in after.items() if e == 1 for i in ids]
    assert len(set(epoch1)) == len(epoch1), "the resumed stream repeated rows"
    assert N_TRAIN - 2 * 8 <= len(epoch1) < N_TRAIN, len(epoch1)
    assert torch.load(tmp_path / "checkpoints/last.ckpt", weights_only=False)["epoch"] == 1
