"""One contract over every task that predicts (``vitkit/tasks/protocol.py``): its recipe trains a step through
``vitkit train``, and ``vitkit evaluate``, ``export``, ``predict`` and the server read the checkpoint, the ONNX export
scoring, predicting and answering as the checkpoint does. A task's learning is its own tests'; this is what every
task's commands owe the user alike, written once."""

import base64
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from sklearn.datasets import load_digits

from tests.commands import run_cli
from vitkit.tasks import registry

from .tasks.depth_scenes import write_depth_folder
from .tasks.detection_scenes import write_coco
from .tasks.segmentation_digits import write_digit_masks

TINY = '{"patch_size": 8, "embed_dim": 32, "depth": 4, "num_heads": 2}'


def _digit_folder(root: Path) -> Path:
    """An ImageNet-layout folder of real digits: 4 images a class and split, 3 classes."""
    digits = load_digits()
    for split, start in (("train", 0), ("val", 900)):
        for cls in range(3):
            folder = root / split / f"class_{cls}"
            folder.mkdir(parents=True)
            for i in [i for i in np.flatnonzero(digits.target == cls) if i >= start][:4]:
                glyph = Image.fromarray((digits.images[i] * 15).astype(np.uint8)).resize((40, 40))
                glyph.convert("RGB").save(folder / f"{i}.png")
    return root


@dataclass(frozen=True)
class Case:
    """A task's data, recipe and score, as its users give them; ``image``: one validation image, under the data."""

    write: object
    recipe: list[str]
    image: str
    score: str
    predict: list[str] = field(default_factory=list)
    options: dict = field(default_factory=dict)


CASES = {
    "classification": Case(_digit_folder, ["-c", "finetune_small_data"], "val/class_1", "top1"),
    "segmentation": Case(lambda root: write_digit_masks(root, train=8, val=4, size=32, glyph_size=16),
                         ["-c", "seg_finetune_small_data", "--data.num_classes", "4"], "images/val", "mIoU"),
    "detection": Case(lambda root: write_coco(root, {"train": 4, "val": 2}), ["-c", "det_yolos_finetune",
                      "--model.det_tokens", "4"], "val", "mAP", ["--threshold", "0"], {"threshold": 0.0}),
    "depth": Case(lambda root: write_depth_folder(root, {"train": 4, "val": 2}),
                  ["-c", "depth_dpt_finetune", "--model.channels", "16", "--model.kind", "metric",
                   "--data.max_depth", "10"], "images/val", "AbsRel"),
}
OPTIONS = {"topk": 5, "max_patches": None, "mode": "whole"}


def test_every_task_that_predicts_has_its_case_in_the_contract():
    assert set(CASES) == {name for name, task in registry.tasks().items() if task.predictor}


def close(a, b, where: str = "record") -> None:
    """Two answers of one model in two runtimes: the same keys, lists and labels; numbers within 1e-3."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, a, b)
        for key in a:
            close(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), (where, a, b)
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            close(x, y, f"{where}[{i}]")
    elif isinstance(a, float) or isinstance(b, float):
        assert math.isclose(a, b, rel_tol=1e-3, abs_tol=1e-3), (where, a, b)
    else:
        assert a == b, (where, a, b)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_a_tasks_recipe_trains_and_every_command_reads_its_checkpoint_and_export_alike(name, tmp_path, capsys):
    case = CASES[name]
    root = tmp_path / "data"
    case.write(root)
    status, err = run_cli(["train", "fit", *case.recipe, "--data.root", str(root), "--model.model_name",
                           "vit_tiny_patch16_224", "--model.model_overrides", TINY, "--data.img_size", "32",
                           "--data.num_workers", "0", "--data.batch_size", "2", "--trainer.max_steps", "2",
                           "--trainer.accelerator", "cpu", "--trainer.precision", "32-true",
                           "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir",
                           str(tmp_path / "run")], capsys)
    assert status == 0, err
    ckpt, onnx = tmp_path / "run/checkpoints/last.ckpt", tmp_path / "model.onnx"
    status, err = run_cli(["export", str(ckpt), "-o", str(onnx)], capsys)
    assert status == 0, err
    scores = {}
    for source in (["--checkpoint", str(ckpt)], ["--onnx", str(onnx)]):
        out = tmp_path / f"ev_{source[0][2:]}"
        status, err = run_cli(["evaluate", *source, "--data.root", str(root), "--split", "val", "-o", str(out)],
                              capsys)
        assert status == 0, err
        scores[source[0]] = json.loads((out / "metrics.json").read_text())[case.score]
    assert scores["--onnx"] == pytest.approx(scores["--checkpoint"], rel=1e-4, abs=1e-4), scores
    image = sorted((root / case.image).glob("*.png"))[0]
    _predict_alike(case, image, ckpt, onnx, tmp_path, capsys)
    _serve_alike(case, image, ckpt, onnx, name)


def _predict_alike(case: Case, image: Path, ckpt: Path, onnx: Path, tmp_path: Path, capsys) -> None:
    """``vitkit predict`` of the checkpoint and of its export: the same line's labels, the same files written."""
    said = {}
    for source in (["--checkpoint", str(ckpt)], ["--onnx", str(onnx)]):
        out = tmp_path / f"predict_{source[0][2:]}"
        status, err = run_cli(["predict", str(image), *source, *case.predict, "-o", str(out)], capsys)
        assert status == 0, err
        said[source[0]] = {p.name for p in out.iterdir()} if out.is_dir() else set()
    assert said["--checkpoint"] == said["--onnx"], said
    for written in said["--checkpoint"]:
        assert written.startswith(image.stem), said


def _serve_alike(case: Case, image: Image.Image, ckpt: Path, onnx: Path, name: str) -> None:
    """The server's model code on the checkpoint and on its export, two images of two shapes in one request: JSON
    answers equal to the predictor's records of each image alone (with its files as base64 where the task serves
    one), the checkpoint's and the export's alike; ``format=overlay``, where the task draws one, its picture."""
    from vitkit.serving.api import VitkitAPI
    from vitkit.serving.model import load_predictor, source_of

    first = Image.open(image).convert("RGB")
    pictures = [first, first.resize((first.width * 3 // 4, first.height))]  # another shape, batched with the first
    data = []
    for picture in pictures:
        buffer = io.BytesIO()
        picture.save(buffer, format="PNG")
        data.append(base64.b64encode(buffer.getvalue()).decode())
    options = {**OPTIONS, **case.options}
    answers = []
    for path in (ckpt, onnx):
        api = VitkitAPI(source_of(str(path), False), options, threads=1)
        api.setup("cpu")
        predictor, task = load_predictor(source_of(str(path), False), options)
        assert task == name
        served = api.encode_response(api.predict(api.decode_request({"images": data, "format": "json"})))
        for picture, answer in zip(pictures, served["predictions"], strict=True):
            expected = predictor.result(picture, predictor.run([predictor.prepare(picture)])[0], options)
            close({k: answer[k] for k in expected.record}, expected.record)
            for key in set(answer) - set(expected.record):  # a file of the prediction's, as base64 (a mask, a map)
                assert base64.b64decode(answer[key]) in expected.files.values(), key
            answers.append({k: answer[k] for k in expected.record})
        if getattr(predictor, "draws_overlay", False):
            drawn = api.encode_response(api.predict(api.decode_request({"images": data[:1], "format": "overlay"})))
            assert drawn.media_type == "image/png"
            assert Image.open(io.BytesIO(drawn.body)).size == first.size
    close(answers[2:], answers[:2])
