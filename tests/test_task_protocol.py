"""The task protocol (``vitkit/tasks/protocol.py``): every command finds a task through it, and a task added as one
package outside vitkit (``tests/fixtures/toy_task``: per-image regression, named under the ``vitkit.tasks`` entry
point group) trains, predicts, evaluates and exports through the ``vitkit`` command with no edit to vitkit."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vitkit.cli import main
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


@pytest.fixture
def toy_site(tmp_path, monkeypatch):
    """The toy task's distribution on the path, as ``pip install`` leaves one; gone again after the test."""
    shutil.copytree(FIXTURE, tmp_path / "site")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    registry.tasks.cache_clear()
    yield tmp_path
    monkeypatch.undo()
    registry.tasks.cache_clear()
    for name in [m for m in sys.modules if m == "toy_regression" or m.startswith("toy_regression.")]:
        del sys.modules[name]


@pytest.mark.slow
def test_a_toy_task_package_trains_predicts_evaluates_and_exports_through_the_commands(toy_site, capsys,
                                                                                      monkeypatch):
    tmp_path = toy_site
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("VITKIT_TRACEBACK", "1")

    def vitkit(*args: str) -> str:
        status = main(list(args))
        said = capsys.readouterr()
        assert not status, (args, said.err[-3000:])
        return said.out

    assert "regression" in registry.tasks()  # found by its entry point, as an installed package's
    vitkit("train", "fit", "--seed_everything", "0", "--model", "toy_regression.Regressor", "--data",
           "toy_regression.Brightness",
           "--trainer.max_epochs", "4", "--trainer.accelerator", "cpu", "--trainer.devices", "1",
           "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp_path / "run"))
    ckpt = next((tmp_path / "run").rglob("*.ckpt"))  # Lightning's own checkpoint callback: no recipe names one
    image = tmp_path / "grey.png"
    Image.fromarray(np.full((40, 40, 3), 204, np.uint8)).save(image)  # brightness 0.8
    out = vitkit("predict", str(image), "--checkpoint", str(ckpt))
    torch_value = float(out.split("brightness ")[1].split()[0])
    assert abs(torch_value - 0.8) < 0.25, out
    vitkit("evaluate", "--checkpoint", str(ckpt), "--data", "toy_regression.Brightness", "-o", str(tmp_path / "ev"))
    scores = json.loads((tmp_path / "ev" / "metrics.json").read_text())
    assert scores["mae"] < scores["mae_of_the_mean"], scores  # it learned: below predicting the mean
    vitkit("export", str(ckpt), "-o", str(tmp_path / "reg.onnx"))
    out = vitkit("predict", str(image), "--onnx", str(tmp_path / "reg.onnx"))
    assert float(out.split("brightness ")[1].split()[0]) == pytest.approx(torch_value, abs=2e-3)


def test_an_export_written_again_at_the_same_path_is_read_again_by_evaluate(tmp_path):
    """``vitkit evaluate --onnx`` finds the task by the file's metadata: a second export to the same path in one
    Python process (a notebook's, a test's) is that file, not the first one remembered."""
    import onnx
    from onnx import TensorProto, helper

    from vitkit.cli.evaluate import _task

    def write(task: str) -> None:
        graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 8, 8])])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        for key, value in {"task": task, "input_size": "[3, 8, 8]", "mean": "[0.5, 0.5, 0.5]",
                           "std": "[0.5, 0.5, 0.5]"}.items():
            model.metadata_props.add(key=f"vitkit.{key}", value=value)
        onnx.save(model, path)

    path = str(tmp_path / "model.onnx")
    write("classification")
    assert _task(["--onnx", path]).name == "classification"
    write("depth")
    assert _task(["--onnx", path]).name == "depth"
