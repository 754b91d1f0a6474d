"""Streamed batches are as mixed as a uniform draw, from a class-sorted folder (prepare-data writes every split in
a seeded random order), and a streamed run learns as well as the folder it was converted from."""

import json
import shutil
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from scipy.stats import chisquare
from sklearn.datasets import load_digits

from vitkit.cli.train import cli_main
from vitkit.data.shards import MARKER, prepare_data
from vitkit.lit import StreamingImageDataModule

from .conftest import ROOT, _solid

pytestmark = pytest.mark.slow

CLASSES, PER_CLASS, BATCH = 10, 40, 16  # 400 training samples, about 12 batches of 16 per rank and epoch
N = CLASSES * PER_CLASS
SIMULATED = 4000  # uniform draws behind each bound


@pytest.fixture(scope="module")
def sorted_folder(tmp_path_factory) -> Path:
    """10 class folders of solid images whose colour encodes a sample id; class c holds ids 40c .. 40c+39, so the
    folder's own order is class after class."""
    root = tmp_path_factory.mktemp("sorted")
    for c in range(CLASSES):
        for split, ids in (("train", range(c * PER_CLASS, (c + 1) * PER_CLASS)), ("val", [N + c])):
            (root / split / f"c{c}").mkdir(parents=True, exist_ok=True)
            for i in ids:
                _solid(i).save(root / split / f"c{c}/{i:04d}.png")
    return root


@pytest.fixture(scope="module")
def mixed_shards(sorted_folder, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mixed") / "out"
    prepare_data(sorted_folder, out, workers=2, chunk_bytes="4KB")
    return out


def _class_sorted_copy(sorted_folder: Path, shards: Path, out: Path) -> Path:
    """The same files written class after class, as prepare-data did before it shuffled (format 1 then; marked
    as the current format here, so that the loader reads it and the measure can be seen to fail on it)."""
    import litdata

    from vitkit.data.shards import _convert_one

    items = [[str(f.relative_to(sorted_folder)), c, f"c{c}"] for c in range(CLASSES)
             for f in sorted((sorted_folder / "train" / f"c{c}").iterdir())]
    (out / "log").mkdir(parents=True)
    litdata.optimize(fn=partial(_convert_one, root=str(sorted_folder), skipped_log=str(out / "log/skipped")),
                     inputs=items, output_dir=str(out / "train"), chunk_bytes="4KB", num_workers=2,
                     start_method="fork")
    shutil.copytree(shards / "val", out / "val")
    shutil.copy(shards / MARKER, out / MARKER)
    return out


def _stream(shards: Path, monkeypatch, epochs: int = 3) -> list[list[list[list[int]]]]:
    """Sample ids of every training batch, ``[epoch][rank][batch]``, of 2 ranks (litdata's WORLD_SIZE /
    GLOBAL_RANK) with 2 loader workers each; augmentation that would change a solid colour is off."""
    runs = [[[], []] for _ in range(epochs)]
    for rank in (0, 1):
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("GLOBAL_RANK", str(rank))
        dm = StreamingImageDataModule(str(shards), img_size=16, batch_size=BATCH, num_workers=2, auto_augment=None,
                                      re_prob=0.0, color_jitter=None, mean=(0.0,) * 3, std=(1.0,) * 3, seed=3)
        dm.setup("fit")
        loader = dm.train_dataloader()
        for epoch in range(epochs):
            for x, _, _ in loader:
                if x is not None:  # a padding batch of the shorter rank
                    assert x.dtype == torch.uint8  # the training split crosses to the device as bytes
                    r, g = x[:, :2, 0, 0].long().div(4, rounding_mode="floor").T.tolist()
                    runs[epoch][rank].append([a + 64 * b for a, b in zip(r, g, strict=True)])
    return runs


def _distinct(ranks: list[list[list[int]]]) -> float:
    """Mean number of classes in the full batches of both ranks."""
    return float(np.mean([len({i // PER_CLASS for i in b}) for r in ranks for b in r if len(b) == BATCH]))


def _uniform_band(full_batches: int) -> tuple[float, float]:
    """Where the mean number of classes per batch lies for batches of a uniformly shuffled split: the 0.1% and
    99.9% quantiles of 4,000 draws."""
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(CLASSES), PER_CLASS)
    means = [np.mean([len(set(b)) for b in rng.permutation(labels)[:full_batches * BATCH].reshape(-1, BATCH)])
             for _ in range(SIMULATED)]
    return float(np.quantile(means, 0.001)), float(np.quantile(means, 0.999))


def _first_batches_p(ranks: list[list[list[int]]], k: int = 6) -> float:
    """Chi-square p-value of the class histogram of the first ``k`` batches of each rank against the split's
    equal class sizes."""
    head = [i for r in ranks for b in r[:k] for i in b]
    counts = np.bincount([i // PER_CLASS for i in head], minlength=CLASSES)
    return float(chisquare(counts).pvalue)


def test_a_class_sorted_folder_streams_in_batches_as_mixed_as_a_uniform_draw(sorted_folder, mixed_shards,
                                                                             tmp_path, monkeypatch):
    assert len(list((mixed_shards / "train").glob("chunk-*.bin"))) >= 8  # many chunks, written by 2 workers
    assert json.loads((mixed_shards / MARKER).read_text())["order"] == "shuffled"
    epochs = _stream(mixed_shards, monkeypatch)
    low, high = _uniform_band(full_batches=sum(len(b) == BATCH for r in epochs[0] for b in r))
    for e, ranks in enumerate(epochs):
        assert all(ranks), f"epoch {e}: a rank read nothing"
        assert sorted(i for r in ranks for b in r for i in b) == list(range(N)), f"epoch {e}: not every sample once"
        assert low <= _distinct(ranks) <= high, (e, _distinct(ranks), (low, high))
        assert _first_batches_p(ranks) > 1e-3, (e, _first_batches_p(ranks))
    for a, b in ((0, 1), (1, 2)):
        assert epochs[a] != epochs[b], "an epoch repeated the order of the one before"
        batches = [{frozenset(x) for r in epochs[e] for x in r} for e in (a, b)]
        assert batches[0] != batches[1], "the same batches again"
    # the same measure on the files written class after class is far outside the band: it can fail. Over 7 runs
    # it gave 2.72-2.96 classes per batch. (The histogram of the first batches did not always tell the two apart
    # there: p 2.6e-9 to 0.017, as the chunk layout of a 2-worker conversion varies between runs.)
    sorted_epochs = _stream(_class_sorted_copy(sorted_folder, mixed_shards, tmp_path / "sorted"), monkeypatch, 1)
    assert _distinct(sorted_epochs[0]) < low / 2, _distinct(sorted_epochs[0])


def test_a_dataset_converted_class_after_class_is_refused_with_the_command_that_converts_it_again(
        sorted_folder, mixed_shards, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(mixed_shards, old)
    info = json.loads((old / MARKER).read_text())
    info.pop("order"), info.pop("seed")
    (old / MARKER).write_text(json.dumps({**info, "format": 1}))
    with pytest.raises(ValueError, match=rf"class after class.* `vitkit prepare-data .*sorted\d* {old} --overwrite`"):
        StreamingImageDataModule(str(old))
    # an unfinished conversion by that vitkit is not resumed in the old order
    (old / MARKER).unlink()
    inputs = old / ".vitkit_inputs.json"
    inputs.write_text(json.dumps({**json.loads(inputs.read_text()), "format": 1}))
    with pytest.raises(FileExistsError, match="unfinished conversion by an earlier vitkit.*--overwrite"):
        prepare_data(sorted_folder, old)


def test_prepare_data_seed_draws_another_order_and_the_same_seed_the_same(sorted_folder, mixed_shards, tmp_path):
    from litdata import StreamingDataset

    def order(shards: Path) -> list[str]:
        ds = StreamingDataset(str(shards / "train"))
        return [ds[i]["path"] for i in range(len(ds))]

    prepare_data(sorted_folder, tmp_path / "again", workers=2, chunk_bytes="4KB")
    prepare_data(sorted_folder, tmp_path / "other", workers=2, chunk_bytes="4KB", seed=1)
    assert order(tmp_path / "again") == order(mixed_shards) != order(tmp_path / "other")
    assert sorted(order(tmp_path / "other")) == sorted(order(mixed_shards))


# -- learning: the same digits from the folder and from its shards ----------------------------------------------

@pytest.fixture(scope="module")
def digits_folder(tmp_path_factory) -> Path:
    """The 1,797 digits as 32 px PNGs, 360 held out, in class folders; and the same folder converted."""
    root = tmp_path_factory.mktemp("digits")
    d = load_digits()
    for k, i in enumerate(np.random.default_rng(0).permutation(len(d.target))):
        folder = root / ("val" if k < 360 else "train") / str(d.target[i])
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray((d.images[i] * 15).astype(np.uint8)).resize((32, 32), Image.BILINEAR).save(folder / f"{i}.png")
    prepare_data(root, root.parent / "digits_shards", workers=2)
    return root


def _val_top1(tmp_path: Path, *data: str) -> float:
    cli = cli_main(["fit", "--config", str(ROOT / "configs/vit_tiny_digits.yaml"), "--trainer.accelerator", "cpu",
                    "--trainer.default_root_dir", str(tmp_path), "--trainer.logger", "false",
                    "--trainer.enable_progress_bar", "false", "--trainer.enable_checkpointing", "false",
                    "--trainer.callbacks", "[]", "--trainer.max_epochs", "10", "--model.recipe.warmup_epochs", "1",
                    "--model.model_overrides", '{"depth": 1, "embed_dim": 48, "num_heads": 2, "patch_size": 4}',
                    *data, "--data.img_size", "16", "--data.batch_size", "32", "--data.num_workers", "1",
                    "--data.auto_augment", "null", "--data.re_prob", "0", "--data.color_jitter", "null",
                    "--data.hflip", "0", "--data.scale", "[0.7, 1.0]"])
    return float(cli.trainer.callback_metrics["val/top1"])


@pytest.mark.timeout(600)
def test_a_streamed_run_learns_the_digits_as_well_as_the_folder_it_came_from(digits_folder, tmp_path):
    """The same recipe, seed and arguments from both sources, 10 epochs. Over seeds 0-4 the folder reached
    0.686-0.811 and the shards 0.711-0.839 val top-1, the shards minus the folder -0.042 to +0.153 per seed (at
    20 epochs: 0.844-0.894, 0.856-0.942, -0.036 to +0.097); shards written class after class (the order before
    the shuffled write) stay at chance (0.09 at seed 0). The bounds sit well outside that spread."""
    folder = _val_top1(tmp_path / "folder", "--data", "vitkit.lit.ImageFolderDataModule",
                       "--data.root", str(digits_folder))
    stream = _val_top1(tmp_path / "stream", "--data", "vitkit.lit.StreamingImageDataModule",
                       "--data.root", str(digits_folder.parent / "digits_shards"))
    assert folder > 0.5, folder  # chance is 0.1
    assert stream > folder - 0.2, (stream, folder)
