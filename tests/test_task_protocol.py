"""The task protocol (``vitkit/tasks/protocol.py``): every command finds a task through it, and a task added as one
package outside vitkit (``tests/fixtures/toy_task``: per-image regression, named under the ``vitkit.tasks`` entry
point group) trains, predicts, evaluates and exports through the ``vitkit`` command with no edit to vitkit."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vitkit.tasks import registry
from vitkit.tasks.protocol import Task

FIXTURE = Path(__file__).parent / "fixtures" / "toy_task"


def test_the_tasks_are_found_without_a_list_and_without_torch():
    """vitkit's task packages declare themselves (their ``task`` module), and finding them imports no torch: an ONNX
    file's command starts without it."""
    code = ("import sys\nfrom vitkit.tasks import registry\nprint(sorted(registry.tasks()))\n"
            "assert 'torch' not in sys.modules and 'lightning' not in sys.modules, 'imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "['classification', 'depth', 'detection', 'pretraining', 'segmentation', 'text']"
    assert registry.for_module("vitkit.lit.Segmenter").name == "segmentation"
    assert registry.for_module("vitkit.tasks.segmentation.segmenter.Segmenter").name == "segmentation"
    assert registry.for_onnx({}).name == "classification" and registry.other_files().name == "classification"
    assert registry.links()["ignore_index"] == "ignore_index"  # the segmenter's, linked from its data by train


def test_a_task_that_is_not_a_task_or_names_another_is_refused(monkeypatch):
    with pytest.raises(TypeError, match="not a vitkit.tasks.protocol.Task"):
        registry._add({}, object(), "x")
    with pytest.raises(ValueError, match="two tasks are named 'classification'"):
        registry._add({"classification": None}, Task("classification", ()), "x")


@pytest.mark.slow
def test_a_toy_task_package_trains_predicts_evaluates_and_exports_through_the_commands(tmp_path):
    shutil.copytree(FIXTURE, tmp_path / "site")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site"), "VITKIT_TRACEBACK": "1"}

    def vitkit(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "vitkit.cli", *args], capture_output=True, text=True,
                              timeout=600, env=env, cwd=tmp_path)
        assert done.returncode == 0, (args, done.stdout[-2000:], done.stderr[-3000:])
        return done.stdout

    vitkit("train", "fit", "--model", "toy_regression.Regressor", "--data", "toy_regression.Brightness",
           "--trainer.max_epochs", "4", "--trainer.accelerator", "cpu", "--trainer.devices", "1",
           "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp_path / "run"))
    ckpt = next((tmp_path / "run").rglob("*.ckpt"))  # Lightning's own checkpoint callback: no recipe names one
    image = tmp_path / "grey.png"
    Image.fromarray(np.full((40, 40, 3), 204, np.uint8)).save(image)  # brightness 0.8
    said = vitkit("predict", str(image), "--checkpoint", str(ckpt))
    torch_value = float(said.split("brightness ")[1].split()[0])
    assert abs(torch_value - 0.8) < 0.25, said
    vitkit("evaluate", "--checkpoint", str(ckpt), "--data", "toy_regression.Brightness", "-o", str(tmp_path / "ev"))
    scores = json.loads((tmp_path / "ev" / "metrics.json").read_text())
    assert scores["mae"] < scores["mae_of_the_mean"], scores  # it learned: below predicting the mean
    vitkit("export", str(ckpt), "-o", str(tmp_path / "reg.onnx"))
    said = vitkit("predict", str(image), "--onnx", str(tmp_path / "reg.onnx"))
    assert float(said.split("brightness ")[1].split()[0]) == pytest.approx(torch_value, abs=2e-3)
