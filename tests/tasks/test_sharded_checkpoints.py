"""Sharded (FSDP2) checkpoints on CPU processes: two nodes on loopback killed during a save into one root and
resumed, resuming on another number of processes, and a sharded checkpoint read, converted, predicted and
exported as saved. Apart from test_sharded.py so that the two files run side by side on two workers."""

import shutil
from pathlib import Path

import pytest
import torch

from .conftest import PROBES, launch, run_in_repo, run_on_two_nodes

pytestmark = pytest.mark.slow

TINY_L = '{"depth": 2, "embed_dim": 32, "num_heads": 2, "patch_size": 8, "drop_path_rate": 0.1}'


def _recipe_args(root: Path, devices: int, epochs: int, *extra: str) -> list[str]:
    """The FSDP2 recipe as it ships (bf16-mixed, activation checkpointing, EMA, mixup, accumulation over 2) on CPU
    processes, with a tiny ViT on the digits at their own 32 px (the recipe's 224 px made each process draw 1 GB
    of resized digits and page-fault through 10 GB, the most of a run's time): 4 batches, 2 optimizer steps per
    epoch."""
    root.mkdir(parents=True, exist_ok=True)
    return ["train.py", "fit", "--config", "vit_large_in1k_fsdp", "--trainer.accelerator", "cpu",
            "--trainer.devices", str(devices), "--data", "vitkit.lit.DigitsDataModule", "--data.batch_size", "16",
            "--data.img_size", "32",
            "--model.model_overrides", TINY_L, "--trainer.max_epochs", str(epochs), "--trainer.limit_train_batches",
            "4", "--trainer.limit_val_batches", "1", "--trainer.logger", "false", "--trainer.default_root_dir",
            str(root), "--trainer.callbacks+=ddp_probe.RecordTraining", "--trainer.callbacks.out_dir", str(root),
            *extra]


def _recipe(root: Path, devices: int, epochs: int, *extra: str):
    """The recipe on ``devices`` processes of one node, started as a launcher would; rank 0's outcome (every rank's
    must be a success)."""
    ranks = launch(_recipe_args(root, devices, epochs, *extra), 1, devices, env=PROBES, timeout=300)
    for rank in ranks[1:]:
        assert rank.returncode == 0, rank.stderr[-3000:]
    return ranks[0]


def _on_two_nodes(root: Path, epochs: int, *extra: str) -> list:
    """The recipe on two 1-process nodes into one shared root, with deterministic algorithms (as a user asks for
    runs that repeat exactly: the attention's ``auto`` then follows its static rule instead of timing)."""
    return run_on_two_nodes(_recipe_args(root, 1, epochs, "--trainer.num_nodes", "2", "--trainer.deterministic",
                                         "true", *extra), env=PROBES)


def _step(checkpoint: Path) -> int:
    return torch.load(checkpoint / "meta.pt", weights_only=False)["global_step"]


def _assert_same_weights(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-5, rtol=0, msg=lambda m, k=k: f"{k}: {m}")


def _losses(root: Path, rank: int) -> list[str]:
    return (root / f"losses{rank}.txt").read_text().splitlines()


@pytest.mark.timeout(900)
def test_two_nodes_killed_during_a_sharded_save_keep_the_last_checkpoint_and_resume_as_if_never_killed(tmp_path):
    """The shipped recipe on two 1-process nodes (``NODE_RANK``, ``MASTER_ADDR`` on loopback) into one shared root,
    killed while writing the checkpoint of its last epoch (epoch 1, step 4), after every shard was written:
    ``last.ckpt`` is still epoch 0's, whole, with each node's shard; both nodes logged their losses. Resumed
    with ``--ckpt_path last`` into the same root, they append to their logs and end with the weights (EMA
    included) of two nodes that were never killed. (Not those of one node with 2 processes: there the model is
    sharded within the node, here replicated across nodes, and the bf16 reductions differ, by up to 1.6e-3.)"""
    for node in _on_two_nodes(tmp_path / "full", 2):
        assert node.returncode == 0, node.stderr[-3000:]
    root = tmp_path / "killed"
    killed = _on_two_nodes(root, 2, "--trainer.callbacks+=ddp_probe.KillAfterShards", "--trainer.callbacks.step", "4")
    assert all(node.returncode != 0 for node in killed)
    last = root / "checkpoints/last.ckpt"
    assert last.is_dir() and _step(last) == 2 and (last / ".metadata").exists()
    assert sorted(p.name for p in last.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert len(_losses(root, 0)) == len(_losses(root, 1)) == 8  # 4 batches in each of 2 epochs
    # and as if a later save of the same state were killed between its two renames: no last.ckpt, the previous
    # one as last.ckpt.old, the new one whole as last.ckpt.saving
    for cut_short in last.parent.glob("*.saving"):  # the save the kill interrupted
        shutil.rmtree(cut_short)
    shutil.copytree(last, last.with_name("last.ckpt.saving"))
    last.replace(last.with_name("last.ckpt.old"))
    resumed = _on_two_nodes(root, 2, "--ckpt_path", "last")
    for node in resumed:
        assert node.returncode == 0, node.stderr[-3000:]
    assert "Restored all states from the checkpoint at" in resumed[0].stderr + resumed[0].stdout
    assert _step(last) == 4 and not list(last.parent.glob("*.saving")) and not list(last.parent.glob("*.old"))
    assert len(_losses(root, 0)) == len(_losses(root, 1)) == 12  # epoch 1 again, appended
    _assert_same_weights(torch.load(tmp_path / "full/weights.pt"), torch.load(root / "weights.pt"))


def _run(root: Path, i: int, devices: int, epochs: int) -> None:
    extra = ["--trainer.callbacks+=ddp_probe.RecordStartWeights", "--trainer.callbacks.out_dir", str(root / f"run{i}")]
    if i:
        extra += ["--ckpt_path", str(root / f"run{i - 1}/checkpoints/last.ckpt")]
    out = _recipe(root / f"run{i}", devices, epochs, *extra)
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory) -> Path:
    """One epoch of the recipe on 1 process, saved sharded: the start of the resume chain and the folder read,
    converted, predicted and exported below (one run for both)."""
    root = tmp_path_factory.mktemp("sharded")
    _run(root, 0, 1, 1)
    return root


@pytest.mark.timeout(900)
def test_a_sharded_checkpoint_resumes_on_another_number_of_processes(one_process_run):
    """Saved by 1 process, resumed on 2; saved by those 2, resumed on 1: each run starts from the weights the
    previous one ended with."""
    tmp_path = one_process_run
    for i, (devices, epochs) in enumerate([(1, 1), (2, 2), (1, 3)]):
        if i:
            _run(tmp_path, i, devices, epochs)
        assert _step(tmp_path / f"run{i}/checkpoints/last.ckpt") == 2 * epochs
        if i:
            _assert_same_weights(torch.load(tmp_path / f"run{i - 1}/weights.pt"),
                                 torch.load(tmp_path / f"run{i}/start_weights.pt"))


@pytest.mark.timeout(600)
def test_a_sharded_checkpoint_is_read_converted_predicted_and_exported_as_saved(one_process_run, tmp_path):
    """The folder FSDP2 wrote goes wherever a checkpoint file goes: ``create_model(checkpoint=)`` (name and size
    from its hyper-parameters), ``vitkit convert SHARDED -o model.safetensors``, ``vitkit predict`` and ``vitkit
    export``; a ``.metadata`` that would import anything else is refused before torch unpickles it."""
    import pickle

    import vitkit
    from vitkit.checkpoints import UnsafeCheckpointError

    sharded = one_process_run / "run0/checkpoints/last.ckpt"
    net = vitkit.create_model(checkpoint=sharded)
    assert net.name == "vit_large_patch16_224" and net.load_report.format == "lightning"
    trained = torch.load(one_process_run / "run0/weights.pt")
    for k, v in net.state_dict().items():
        assert torch.equal(v, trained[f"model.{k}"]), k
    converted = tmp_path / "model.safetensors"
    cli = ["-m", "vitkit.cli"]
    assert run_in_repo([*cli, "convert", str(sharded), "-o", str(converted)]).returncode == 0
    import json

    again = vitkit.create_model("vit_large_patch16_224", checkpoint=converted, num_classes=10, img_size=32,
                                **json.loads(TINY_L))
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(again.eval()(x), net.eval()(x), atol=0, rtol=0)
    from PIL import Image

    Image.new("RGB", (40, 40), (200, 30, 30)).save(tmp_path / "img.png")
    pred = run_in_repo([*cli, "predict", str(tmp_path / "img.png"), "--checkpoint", str(sharded), "--topk", "1"])
    assert pred.returncode == 0 and pred.stdout.startswith(f"{tmp_path / 'img.png'}: "), pred.stderr[-2000:]
    exported = run_in_repo([*cli, "export", str(sharded), "-o", str(tmp_path / "m.onnx")], timeout=300)
    assert exported.returncode == 0 and (tmp_path / "m.onnx").exists(), exported.stderr[-2000:]

    class Evil:
        def __reduce__(self):
            return (print, ("executed",))

    evil = shutil.copytree(sharded, tmp_path / "evil.ckpt")  # the fixture's folder stays whole for other tests
    (evil / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(UnsafeCheckpointError, match="builtins.print"):
        vitkit.create_model(checkpoint=evil)
