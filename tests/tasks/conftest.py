import json
import logging
import os
import socket
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from sklearn.datasets import load_digits

from tests import forkserver

ROOT = Path(__file__).resolve().parents[2]
TINY_VIT = '{"depth": 1, "embed_dim": 32, "num_heads": 2, "patch_size": 8}'
PROBES = {"PYTHONPATH": str(ROOT / "tests" / "tasks")}  # the test callbacks (ddp_probe) for the processes tests start


@pytest.fixture(autouse=True)
def _offline_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))  # its debug logs, not the home's cache
    monkeypatch.setenv("WANDB_SILENT", "true")


@pytest.fixture(scope="session")
def image_folder(tmp_path_factory) -> Path:
    """A real ImageNet-layout folder: digits written as PNG and JPEG files, 3 classes."""
    root = tmp_path_factory.mktemp("imagefolder")
    digits = load_digits()
    for split, start in (("train", 0), ("val", 900)):
        for cls in (0, 1, 2):
            d = root / split / f"class_{cls}"
            d.mkdir(parents=True)
            idx = np.flatnonzero(digits.target == cls)
            idx = idx[idx >= start][:6]
            for k, i in enumerate(idx):
                img = Image.fromarray((digits.images[i] * 15).astype(np.uint8)).resize((40, 40)).convert("RGB")
                img.save(d / f"{i}.{'png' if k % 2 else 'jpg'}")
    return root


def write_few_shot_digits(root: Path) -> Path:
    """8 training and 40 validation images per class (digits 0-2, as 40x40 PNGs), so that a fine-tuned and a
    scratch model are told apart by more than a handful of validation images."""
    digits = load_digits()
    for split, start, n in (("train", 0, 8), ("val", 900, 40)):
        for cls in (0, 1, 2):
            d = root / split / f"class_{cls}"
            d.mkdir(parents=True)
            idx = np.flatnonzero(digits.target == cls)
            for i in idx[idx >= start][:n]:
                Image.fromarray((digits.images[i] * 15).astype(np.uint8)).resize((40, 40)).convert("RGB").save(
                    d / f"{i}.png")
    return root


N_TRAIN, N_VAL = 75, 12  # the streaming tests' folder of solid images


def _solid(i: int, size: int = 16) -> Image.Image:
    """A solid image whose colour encodes ``i`` (red and green levels 4 apart, robust to resampling)."""
    return Image.new("RGB", (size, size), (4 * (i % 64) + 2, 4 * (i // 64) + 2, 128))


@pytest.fixture(scope="session")
def id_folder(tmp_path_factory) -> Path:
    """ImageNet layout, 3 classes, PNG and JPEG files, and two broken files in train."""
    root = tmp_path_factory.mktemp("ids")
    for split, ids in (("train", range(N_TRAIN)), ("val", range(100, 100 + N_VAL))):
        for i in ids:
            d = root / split / f"class_{i % 3}"
            d.mkdir(parents=True, exist_ok=True)
            _solid(i).save(d / f"{i}.png")
    _solid(63, size=40).save(root / "val/class_0/photo.jpg", quality=95)  # one JPEG too
    (root / "train/class_0/broken.jpg").write_bytes(b"\xff\xd8\xff not a jpeg")
    (root / "train/class_1/truncated.png").write_bytes((root / "train/class_1/1.png").read_bytes()[:60])
    return root


@pytest.fixture(scope="session")
def shards(id_folder, tmp_path_factory) -> Path:
    """``id_folder`` converted by ``vitkit prepare-data``."""
    from vitkit.data.shards import prepare_data

    out = tmp_path_factory.mktemp("shards") / "out"
    prepare_data(id_folder, out, workers=2, chunk_bytes="4KB")
    return out


def run_in_repo(args, env: dict | None = None, timeout: float | None = None) -> subprocess.CompletedProcess:
    """``python ARGS`` in the repository, its output captured: a child of the tests' prepared interpreter
    (``tests/forkserver.py``), which has torch, Lightning and vitkit imported already."""
    return forkserver.run(list(args), env={**os.environ, **(env or {})}, cwd=ROOT, timeout=timeout)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: list[str], nodes: int, devices: int, env: dict | None = None, timeout: int = 300) -> list:
    """``python ARGS`` in each of ``nodes`` x ``devices`` processes on loopback, as a launcher on each node of a
    job starts them (``NODE_RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``): Lightning starts no process of its own. ARGS
    name the same ``--trainer.devices`` and ``--trainer.num_nodes``. Returns each process's CompletedProcess."""
    port = str(_free_port())
    procs = [forkserver.popen(list(args), cwd=ROOT, env={**os.environ, **(env or {}), "MASTER_ADDR": "127.0.0.1",
                                                       "MASTER_PORT": port, "NODE_RANK": str(node),
                                                       "LOCAL_RANK": str(local)})
             for node in range(nodes) for local in range(devices)]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired as e:
        raise forkserver.Hung(e, procs) from e
    finally:
        for p in procs:
            p.kill()
    return [subprocess.CompletedProcess(p.args, p.returncode, out, err) for p, (out, err) in zip(procs, outs,
                                                                                                 strict=True)]


def run_on_two_nodes(args: list[str], env: dict | None = None, timeout: int = 300) -> list:
    """``python ARGS`` as node 0 and node 1 of a 2-node job, one process each; ARGS name ``--trainer.devices 1``
    and ``--trainer.num_nodes 2``."""
    return launch(args, 2, 1, env, timeout)


def run_in_turn(runs: list[list[str]], folder: Path, devices: int = 2, timeout: int = 800) -> list:
    """The training command's runs (``fit ...`` argument lists) one after another in one set of ``devices``
    processes on one node (``tests/tasks/in_turn.py``); the processes' CompletedProcess, each checked for exit 0."""
    (folder / "runs.json").write_text(json.dumps(runs))
    done = launch([str(ROOT / "tests/tasks/in_turn.py"), str(folder / "runs.json")], 1, devices,
                  env=PROBES, timeout=timeout)
    for rank in done:
        assert rank.returncode == 0, rank.stderr[-3000:]
    return done


@pytest.fixture(scope="session")
def digits_run(tmp_path_factory):
    """The demo's recipe for 20 epochs (``test_train.py::test_tiny_vit_learns_digits`` gives its spread): a trained
    model of the digits for the tests that need one (fine-tuning, token merging, a teacher, evaluation). Built once:
    the tests that use it are one work unit (tests/conftest.py)."""
    from vitkit.cli.train import cli_main

    tmp_path = tmp_path_factory.mktemp("digits")
    return cli_main(["fit", "--config", str(ROOT / "configs/vit_tiny_digits.yaml"), "--trainer.accelerator", "cpu",
                     "--trainer.devices", "1", "--trainer.num_nodes", "1", "--trainer.strategy", "auto",
                     "--trainer.precision", "32-true", "--trainer.default_root_dir", str(tmp_path),
                     "--trainer.max_epochs", "20", "--model.recipe.warmup_epochs", "1"])


@pytest.fixture
def said(caplog):
    """What Lightning's info lines say (``rank_zero_info``): its logger keeps the handler and stream it found at
    import, so they are read from the records, not from the captured stream."""
    logger = logging.getLogger("lightning.pytorch")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO)
    yield caplog
    logger.removeHandler(caplog.handler)
