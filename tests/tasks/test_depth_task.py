"""The depth task: a depth model learns its scenes better than the mean depth map does, and evaluate and predict
read it (every task's export, server and commands alike: ``tests/test_task_contract.py``)."""

import csv
import json
import shutil

import numpy as np
import onnx
import pytest
import torch
from PIL import Image

from tests.commands import error_line_of, run_cli
from vitkit.cli import main
from vitkit.evaluation.depth import DepthMetrics, scored

from .depth_scenes import write_depth_folder

TINY = '{"patch_size": 8, "embed_dim": 64, "depth": 4, "num_heads": 2}'
# a tiny model's steps to learn 16 scenes by heart: 20x the recipe's LR for a pretrained backbone, without its
# warmup, layer decay and average
MEMORISE = {"lr": 1e-3, "lr_batch": None, "warmup_epochs": 0, "min_lr": 1e-3, "layer_decay": None, "ema_decay": None,
            "ema_is_model": False}
EPOCHS = 150


@pytest.fixture(scope="module")
def learned(tmp_path_factory):
    """A tiny relative-depth model trained on 16 scenes (its validation split is the same 16 scenes)."""
    root = write_depth_folder(tmp_path_factory.mktemp("depth"), {"train": 16}, seed=3)
    shutil.copytree(root / "images/train", root / "images/val")
    shutil.copytree(root / "depth/train", root / "depth/val")
    run = tmp_path_factory.mktemp("run")
    status = main(["train", "fit", "-c", "depth_dpt_finetune", "--data.root", str(root),
                   "--model.model_name", "vit_tiny_patch16_224", "--model.model_overrides", TINY,
                   "--model.channels", "32", "--model.recipe", json.dumps(MEMORISE), "--data.img_size", "64",
                   "--data.hflip", "0", "--data.scale", "[1, 1]", "--data.batch_size", "8",
                   "--data.num_workers", "0", "--trainer.max_epochs", str(EPOCHS),
                   "--trainer.check_val_every_n_epoch", str(EPOCHS), "--trainer.accelerator", "cpu",
                   "--trainer.precision", "32-true", "--trainer.enable_progress_bar", "false",
                   "--trainer.default_root_dir", str(run)])
    assert status == 0
    return root, run


@pytest.mark.slow
def test_a_depth_model_learns_its_scenes_better_than_the_mean_map_and_evaluate_and_predict_read_it(learned, tmp_path,
                                                                                                    capsys):
    root, run = learned
    ckpt = run / "checkpoints" / "last.ckpt"
    with open(next(run.glob("logs/*/metrics.csv"))) as f:
        last = [r for r in csv.DictReader(f) if r.get("val/AbsRel")][-1]
    # the baseline: the scenes' mean inverse depth map, scored as the model is (aligned by scale and shift)
    maps = [torch.from_numpy(np.load(p)) for p in sorted((root / "depth/val").glob("*.npy"))]
    mean = torch.stack([1 / m for m in maps]).mean(0)
    baseline = DepthMetrics()
    for m in maps:
        p, valid = scored(mean, m, "relative", None)
        baseline.update(p[None], m[None], valid[None])
    floor = baseline.compute()
    assert float(last["val/AbsRel"]) < 0.75 * floor["AbsRel"], (last, floor)  # the digits' depth, not the ground's
    assert float(last["val/delta1"]) > floor["delta1"]
    # evaluate: the checkpoint's scores on the same split are the ones its run logged
    status, err = run_cli(["evaluate", "--checkpoint", str(ckpt), "--data.root", str(root), "--split", "val",
                           "-o", str(tmp_path / "ev")], capsys)
    assert status == 0, err
    metrics = json.loads((tmp_path / "ev/metrics.json").read_text())
    assert metrics["AbsRel"] == pytest.approx(float(last["val/AbsRel"]), rel=1e-4) and metrics["samples"] == 16
    assert len(list((tmp_path / "ev/worst").glob("*.png"))) == 8
    image = root / "images/val/0000.png"  # the export predicts as the checkpoint: test_task_contract.py
    status, err = run_cli(["predict", str(image), "--checkpoint", str(ckpt), "-o", str(tmp_path / "out")], capsys)
    assert status == 0, err
    coloured, sixteen = Image.open(tmp_path / "out/0000_depth.png"), Image.open(tmp_path / "out/0000_depth16.png")
    assert coloured.mode == "RGB" and coloured.size == sixteen.size == (64, 64)
    values = np.load(tmp_path / "out/0000_depth.npy")
    assert values.shape == (64, 64) and values.dtype == np.float32
    spread = (values - values.min()) / (values.max() - values.min()) * 65535  # the 16-bit map's, unrounded
    sixteen = np.asarray(sixteen, dtype=np.float32)
    assert np.abs(spread - sixteen).max() <= 0.5
    truth = 1 / np.load(root / "depth/val/0000.npy")  # nearer is larger in both
    assert np.corrcoef(sixteen.ravel(), truth.ravel())[0, 1] > 0.9


@pytest.mark.slow
def test_a_depth_checkpoint_is_refused_where_it_does_not_fit_in_one_line(learned, tmp_path):
    root, run = learned
    ckpt = str(run / "checkpoints/last.ckpt")
    line = error_line_of(["train", "fit", "-c", "vit_tiny_digits", "--model.checkpoint", ckpt,
                          "--trainer.default_root_dir", str(tmp_path)])
    assert "last.ckpt was written by vitkit.lit.DepthEstimator" in line, line
    line = error_line_of(["predict", str(root / "images/val/0000.png"), "--checkpoint", ckpt, "--threshold", "0.5"])
    assert "a depth model takes the image alone" in line, line
    line = error_line_of(["evaluate", "--checkpoint", ckpt, "--data", "vitkit.lit.DigitsDataModule", "-o",
                          str(tmp_path / "ev")])
    assert line == "error: a depth model is scored on images with depth maps (vitkit.lit.DepthDataModule, " \
        "--data.root DIR), not DigitsDataModule", line


@pytest.mark.slow
def test_int8_keeps_a_depth_models_absrel_and_refuses_one_it_breaks(learned, tmp_path, capsys):
    from vitkit.deploy.onnx_model import OnnxModel
    from vitkit.deploy.quantize import Int8Report, refusal

    root, run = learned
    ckpt = run / "checkpoints" / "last.ckpt"
    cal = write_depth_folder(tmp_path / "cal", {"val": 128}, seed=11)  # 28 calibrate, 100 held out
    assert run_cli(["export", str(ckpt), "-o", str(tmp_path / "fp32.onnx")], capsys)[0] == 0
    # a 64-wide model at 64 px, where int8 kernels differ from CPU to CPU: 10 % of margin
    status, err = run_cli(["export", str(tmp_path / "fp32.onnx"), "--int8", "--calibrate", str(cal),
                           "--calibration-size", "28", "--max-drop", "10", "-o", str(tmp_path / "int8.onnx")], capsys)
    assert status == 0, err
    facts = OnnxModel(str(tmp_path / "int8.onnx")).meta["int8"]
    assert facts["held_out"] == 100 and 0 < facts["fp32_AbsRel"] < 0.5, facts
    # the DPT head's convolutions and the attention's products are int8 too, not only the linear layers
    graph = onnx.load(str(tmp_path / "int8.onnx")).graph
    weights = {t.name for t in graph.initializer}
    dequantized = {n.output[0]: n.input[0] in weights for n in graph.node if n.op_type == "DequantizeLinear"}
    conv = [n for n in graph.node if n.op_type == "Conv"]
    int8_conv = [n for n in conv if n.input[0] in dequantized and dequantized.get(n.input[1])]
    products = [n for n in graph.node if n.op_type == "MatMul"  # two activations, both dequantized
                and all(i in dequantized and not dequantized[i] for i in n.input)]
    assert facts["layers"] == {"linear": facts["layers"]["linear"], "convolution": len(int8_conv),
                               "attention": len(products)} and len(products) > 0 < facts["layers"]["linear"], facts
    # every convolution but the head's last: its output is the depth map, which stays float (not 256 levels)
    assert [n.input[1] in weights for n in conv if n not in int8_conv] == [True], facts
    sample = np.stack([np.asarray(Image.open(p).convert("RGB").resize((64, 64)), np.float32) for p in
                       sorted((cal / "images" / "val").glob("*.png"))[:4]]).transpose(0, 3, 1, 2) / 255
    int8 = OnnxModel(str(tmp_path / "int8.onnx"))
    mean, std = (np.array(int8.meta[k], np.float32)[:, None, None] for k in ("mean", "std"))
    depth = np.asarray(int8(((sample - mean) / std).astype(np.float32)))
    assert len(np.unique(depth)) > 1024, len(np.unique(depth))
    assert facts["int8_AbsRel"] <= 1.1 * facts["fp32_AbsRel"], facts
    # what the gate scored is what evaluate scores on the held-out images (the last 100 of the seeded order)
    kept = np.random.default_rng(0).permutation(128)[28:].tolist()
    held = tmp_path / "held"
    for part in ("images", "depth"):
        (held / part / "val").mkdir(parents=True)
        for k in kept:
            name = f"{k:04d}.png" if part == "images" else f"{k:04d}.npy"
            shutil.copy(cal / part / "val" / name, held / part / "val" / name)
    for name in ("fp32", "int8"):
        status, err = run_cli(["evaluate", "--onnx", str(tmp_path / f"{name}.onnx"), "--data.root", str(held),
                               "--split", "val", "-o", str(tmp_path / f"ev_{name}")], capsys)
        assert status == 0, err
        scored_ = json.loads((tmp_path / f"ev_{name}/metrics.json").read_text())
        assert scored_["samples"] == 100 and scored_["AbsRel"] == pytest.approx(facts[f"{name}_AbsRel"], rel=1e-5)
    # the gate's drop is in percent of fp32's AbsRel (an error: lower is better), and its refusal says so
    report = Int8Report("x.onnx", "static", 28, 100, 0.05, 0.06, 16, lower_better=True, metric="AbsRel")
    assert report.drop == pytest.approx(20.0) and "20.00 % worse" in str(report)
    line = str(refusal(report, 5.0, [("blocks.0.mlp.fc2", 0.3)]))
    assert line.startswith("int8's AbsRel is 20.00 % worse (fp32 0.0500, int8 0.0600 on 100 held-out images), more "
                           "than --max-drop 5;") and "blocks.0.mlp.fc2 (0.300)" in line, line


@pytest.mark.slow
def test_the_linear_probe_recipe_learns_depth_from_a_frozen_backbone_and_exports(learned, tmp_path, capsys):
    """``depth_linear_probe``: a linear head on the frozen backbone of the learned model's run (its weights as a file)
    scores its scenes better than a flat map (what a probe that learned nothing gives, aligned the same way), and its
    ONNX file scores as the checkpoint."""
    from safetensors.torch import save_file

    from vitkit.tasks.depth.inference import load_depth_checkpoint

    root, run = learned
    backbone = load_depth_checkpoint(str(run / "checkpoints/last.ckpt")).backbone
    save_file({k: v.contiguous() for k, v in backbone.state_dict().items()}, str(tmp_path / "backbone.safetensors"))
    probe = tmp_path / "probe"
    status = main(["train", "fit", "-c", "depth_linear_probe", "--data.root", str(root), "--model.model_name",
                   "vit_tiny_patch16_224", "--model.model_overrides", TINY, "--model.checkpoint",
                   str(tmp_path / "backbone.safetensors"), "--data.img_size", "64", "--data.hflip", "0",
                   "--data.scale", "[1, 1]", "--data.batch_size", "4", "--data.num_workers", "0",
                   "--model.recipe.lr", "3e-3", "--trainer.max_epochs", "40", "--trainer.check_val_every_n_epoch",
                   "40", "--trainer.accelerator", "cpu", "--trainer.precision", "32-true",
                   "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(probe)])
    assert status == 0
    with open(next(probe.glob("logs/*/metrics.csv"))) as f:
        last = [r for r in csv.DictReader(f) if r.get("val/AbsRel")][-1]
    maps = [torch.from_numpy(np.load(p)) for p in sorted((root / "depth/val").glob("*.npy"))]
    flat = DepthMetrics()
    for m in maps:
        p, valid = scored(torch.ones_like(m) + 1e-3 * torch.rand_like(m), m, "relative", None)
        flat.update(p[None], m[None], valid[None])
    assert float(last["val/AbsRel"]) < 0.8 * flat.compute()["AbsRel"], (last, flat.compute())
    ckpt = probe / "checkpoints/last.ckpt"
    net = load_depth_checkpoint(str(ckpt))
    assert type(net.head).__name__ == "LinearDepthHead"
    torch.testing.assert_close(net.backbone.state_dict()["blocks.0.attn.qkv.weight"],
                               backbone.state_dict()["blocks.0.attn.qkv.weight"])  # the backbone did not move
    status, err = run_cli(["export", str(ckpt), "-o", str(tmp_path / "probe.onnx")], capsys)
    assert status == 0, err
    status, err = run_cli(["evaluate", "--onnx", str(tmp_path / "probe.onnx"), "--data.root", str(root), "--split",
                           "val", "-o", str(tmp_path / "ev")], capsys)
    assert status == 0, err
    assert json.loads((tmp_path / "ev/metrics.json").read_text())["AbsRel"] == pytest.approx(
        float(last["val/AbsRel"]), rel=1e-4)
