"""Damaged copies of valid files, of every format vitkit reads, through the reader a user's command takes: each
either loads or raises vitkit's ``CheckpointError`` naming the file, whatever the damage (bit flips, a cut, another
format's header spliced on). A format vitkit learns to read later is covered by one more entry in ``FORMATS``.

How many examples each draws comes from the hypothesis profile (tests/conftest.py): 25, derandomized in CI;
``make fuzz`` draws 2,000 each."""

from __future__ import annotations

import functools
import io
import random
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

import vitkit
from vitkit.checkpoints import CheckpointError

pytestmark = pytest.mark.fuzz

TINY = dict(img_size=32, patch_size=8, depth=1, embed_dim=32, num_heads=2, num_classes=3)
NAME = "vit_tiny_patch16_224"


def _tiny() -> torch.nn.Module:
    torch.manual_seed(0)
    return vitkit.create_model(NAME, **TINY).eval()


def _by_name(path: Path):  # a file that does not record its model: the user names the preset
    return vitkit.create_model(NAME, checkpoint=path, **TINY)


def _recorded(path: Path):  # a file that records its model
    return vitkit.create_model(checkpoint=path)


def _onnx(path: Path):  # what `vitkit predict --onnx` does: load, read the metadata, preprocess, run
    from vitkit.deploy.export import OnnxModel

    model = OnnxModel(path)
    return model(model.preprocess(Image.new("RGB", (40, 40), (90, 30, 200))))


def _lightning_checkpoint() -> dict:
    """A real Lightning checkpoint of the tiny model (one training step), as the training command writes it."""
    return torch.load(io.BytesIO(_lightning_checkpoint_bytes()), weights_only=False)


@functools.cache
def _lightning_checkpoint_bytes() -> bytes:
    import lightning as L

    from vitkit.lit import DigitsDataModule, ImageClassifier, Recipe

    overrides = {k: v for k, v in TINY.items() if k not in ("num_classes", "img_size")}
    module = ImageClassifier(NAME, model_overrides=overrides, num_classes=10, img_size=32,
                             recipe=Recipe(lr=5e-4, weight_decay=0.05))
    root = tempfile.mkdtemp()
    trainer = L.Trainer(max_steps=1, limit_val_batches=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
                        default_root_dir=root)
    trainer.fit(module, DigitsDataModule(img_size=32, batch_size=16))
    with tempfile.TemporaryDirectory() as tmp:
        trainer.save_checkpoint(Path(tmp) / "w.ckpt")
        return (Path(tmp) / "w.ckpt").read_bytes()


def _write_torch_zip(folder: Path) -> Path:
    torch.save(_tiny().state_dict(), folder / "w.pth")
    return folder / "w.pth"


def _write_legacy_pickle(folder: Path) -> Path:
    torch.save(_tiny().state_dict(), folder / "w.bin", _use_new_zipfile_serialization=False)
    return folder / "w.bin"


def _write_safetensors(folder: Path) -> Path:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in _tiny().state_dict().items()}, folder / "w.safetensors")
    return folder / "w.safetensors"


def _write_torchscript(folder: Path) -> Path:
    torch.jit.save(torch.jit.script(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())), folder / "w.pt")
    return folder / "w.pt"


def _write_lightning(folder: Path) -> Path:
    torch.save(_lightning_checkpoint(), folder / "w.ckpt")
    return folder / "w.ckpt"


def _write_sharded(folder: Path) -> Path:
    """The layout Lightning's ModelParallelStrategy (FSDP2) writes: torch's distributed checkpoint of the state dict
    (``.metadata`` and a ``.distcp`` shard) and the rest of the checkpoint in ``meta.pt``."""
    import torch.distributed.checkpoint as dcp

    ckpt = _lightning_checkpoint()
    out = folder / "sharded.ckpt"
    dcp.save({"state_dict": ckpt.pop("state_dict")}, checkpoint_id=out, no_dist=True)
    torch.save(ckpt, out / "meta.pt")
    return out


def _write_export_folder(folder: Path) -> Path:
    return vitkit.save_pretrained(_tiny(), folder / "export", class_names=["a", "b", "c"])


def _write_onnx(folder: Path) -> Path:
    from vitkit.deploy.export import export_onnx

    export_onnx(_tiny(), folder / "w.onnx", dynamic_size=False)
    return folder / "w.onnx"


def _write_int8_program(folder: Path) -> Path:
    """An int8 .pt2 as ``vitkit export --format torch-export --int8`` writes it (its gate and timing left out)."""
    import json

    from vitkit.deploy.export import metadata, prepare
    from vitkit.deploy.quantize_program import _save, convert

    m, _ = prepare(_tiny(), False)
    x = np.random.default_rng(0).standard_normal((8, 3, 32, 32)).astype(np.float32)
    meta = {**metadata(m, False), "vitkit.int8": json.dumps({"mode": "static"})}
    _save(convert(m, x, []), x, folder / "w.int8.pt2", meta)
    return folder / "w.int8.pt2"


def _write_rf_detr_pth(folder: Path) -> Path:
    """RF-DETR's own file: transformers' RF-DETR's weights (RF-DETR's names) under ``model``, its settings under
    ``args``."""
    from argparse import Namespace

    from tests.models.test_rf_detr import _rf_detr_folder

    theirs = _rf_detr_folder(folder / "rf", hidden=128, heads=2, eps=1e-6)
    args = Namespace(encoder="dinov2_windowed_small", out_feature_indexes=[1, 2, 4], num_windows=2, patch_size=8,
                     positional_encoding_size=8, hidden_dim=32, dec_layers=2, sa_nheads=4, ca_nheads=4,
                     dec_n_points=theirs.config.decoder_n_points, dim_feedforward=64, num_queries=6, group_detr=3,
                     projector_scale=["P4"], class_names=[f"c{i}" for i in range(5)])
    from safetensors.torch import load_file

    torch.save({"model": load_file(folder / "rf" / "model.safetensors"), "args": args}, folder / "rf-detr.pth")
    shutil.rmtree(folder / "rf")
    return folder / "rf-detr.pth"


def _write_lw_detr_folder(folder: Path) -> Path:
    from tests.models.test_lw_detr import _lw_detr_folder

    _lw_detr_folder(folder / "lw")
    return folder / "lw"


def _write_dinov2_depth_head(folder: Path) -> Path:
    from tests.models.test_depth_dpt import _dpt_dinov2, _meta_dpt_head

    torch.save({"state_dict": _meta_dpt_head(_dpt_dinov2())}, folder / "dinov2_vits14_nyu_dpt_head.pth")
    return folder / "dinov2_vits14_nyu_dpt_head.pth"


def _depth_head(path: Path):  # what load_depth_estimator does with Meta's head file and a backbone built apart
    backbone = vitkit.create_model("vit_small_patch14_dinov2", num_classes=0, img_size=56, depth=4, embed_dim=64,
                                   num_heads=1)
    return vitkit.load_depth_estimator(path, backbone=backbone)


def _int8_program(path: Path):  # what load_int8_program reads: the program and its metadata (compiled when called)
    from vitkit.deploy.quantize_program import load_int8_program

    return load_int8_program(path).meta


@dataclass(frozen=True)
class Format:
    """A file format vitkit reads: how to write a valid one, which of its files to damage, and the reader."""

    name: str
    write: Callable[[Path], Path]  # writes into an empty folder; returns what the reader is given
    read: Callable[[Path], object]
    damaged: str = ""  # the file inside a folder format whose bytes are damaged ("": the path itself)


FORMATS = [
    Format("torch zip archive", _write_torch_zip, _by_name),
    Format("legacy pickle", _write_legacy_pickle, _by_name),
    Format("safetensors", _write_safetensors, _by_name),
    Format("TorchScript archive", _write_torchscript, _by_name),
    Format("Lightning .ckpt", _write_lightning, _recorded),
    Format("sharded .metadata", _write_sharded, _recorded, damaged=".metadata"),
    Format("sharded shard", _write_sharded, _recorded, damaged="__0_0.distcp"),
    Format("sharded meta.pt", _write_sharded, _recorded, damaged="meta.pt"),
    Format("config.json", _write_export_folder, _recorded, damaged="config.json"),
    Format("export weights", _write_export_folder, _recorded, damaged="model.safetensors"),
    Format("ONNX", _write_onnx, _onnx),
    Format("int8 .pt2", _write_int8_program, _int8_program),
    Format("RF-DETR .pth", _write_rf_detr_pth, vitkit.load_detector),
    Format("LW-DETR config.json", _write_lw_detr_folder, vitkit.load_detector, damaged="config.json"),
    Format("DINOv2 depth head", _write_dinov2_depth_head, _depth_head),
]


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> dict[str, Path]:
    """Each format's valid file (or folder), written once (``test_the_valid_files_are_read`` reads them)."""
    return {fmt.name: fmt.write(tmp_path_factory.mktemp("valid")) for fmt in FORMATS}


def _bytes_of(path: Path, fmt: Format) -> bytes:
    return (path / fmt.damaged if fmt.damaged else path).read_bytes()


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_peak_memory() -> int:
    """This process's resident memory now, with its high-water mark reset to it (Linux; 0 elsewhere)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return 0
    return _status("VmRSS")


def _peak_memory() -> int:
    return _status("VmHWM") if Path("/proc/self/status").exists() else 0


MUTATIONS = st.one_of(
    st.tuples(st.just("flip"), st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 7)),
                                        min_size=1, max_size=32)),
    st.tuples(st.just("flip rate"), st.floats(0.001, 0.05), st.integers(0, 2**32 - 1)),  # ~2% of the bytes
    st.tuples(st.just("truncate"), st.floats(0, 1, exclude_max=True)),
    st.tuples(st.just("header of"), st.sampled_from([f.name for f in FORMATS]), st.integers(1, 4096)),
    st.tuples(st.just("body of"), st.sampled_from([f.name for f in FORMATS]), st.integers(1, 4096)),
)


def damage(data: bytes, mutation: tuple, other: bytes) -> bytes:
    """Bit flips at given places or at a rate, a cut, or another file's first (or last) bytes spliced in."""
    kind, *args = mutation
    b = bytearray(data)
    if kind == "flip":
        for where, bit in args[0]:
            b[int(where * len(b))] ^= 1 << bit
    elif kind == "flip rate":
        rate, seed = args
        rng = random.Random(seed)
        for _ in range(max(1, int(rate * len(b)))):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    elif kind == "truncate":
        b = b[: int(args[0] * len(b))]
    elif kind == "header of":  # another format's header on this file's body
        n = min(args[1], len(other), len(b))
        b[:n] = other[:n]
    else:  # this file's header on another format's body
        n = min(args[1], len(b))
        b = b[:n] + bytearray(other[n:])
    return bytes(b)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@given(mutation=MUTATIONS)
def test_a_damaged_file_loads_or_is_named(valid, tmp_path_factory, fmt, mutation):
    source = valid[fmt.name]
    other_fmt = next((f for f in FORMATS if f.name == mutation[1]), fmt) if mutation[0].endswith("of") else fmt
    other = _bytes_of(valid[other_fmt.name], other_fmt)
    folder = tmp_path_factory.mktemp("damaged")
    copy = folder / source.name
    if source.is_dir():
        shutil.copytree(source, copy)
    else:
        shutil.copy(source, copy)
    target = copy / fmt.damaged if fmt.damaged else copy
    target.write_bytes(damage(_bytes_of(source, fmt), mutation, other))
    before = _reset_peak_memory()
    try:
        out = fmt.read(copy)
    except CheckpointError as e:
        assert copy.name in str(e), f"the error does not name the file: {e}"
        return
    finally:  # a damaged size field must not make the reader allocate what the file cannot hold
        grown = _peak_memory() - before
        assert grown < 512 * 2**20, f"reading took {grown / 2**20:.0f} MiB more"
    if isinstance(out, np.ndarray):
        assert out.shape == (1, 3)


def test_the_valid_files_are_read(valid):
    """The undamaged files load (a TorchScript archive is refused as such, by name)."""
    for fmt in FORMATS:
        if fmt.name == "TorchScript archive":
            with pytest.raises(CheckpointError, match="TorchScript"):
                fmt.read(valid[fmt.name])
        else:
            fmt.read(valid[fmt.name])
