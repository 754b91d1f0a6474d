"""The model a ``vitkit serve`` command names, as its task's predictor: read once in the command (a damaged file, or a
file of a kind no task serves, refuses to start the server in one line) and once in each LitServe worker."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vitkit.errors import UsageError


def source_of(model: str, pretrained: bool) -> tuple[str, str]:
    """The source a model argument names: an ONNX file, an int8 ``.pt2`` program, a model file or folder vitkit
    reads (a checkpoint, a saved model), or with ``pretrained`` a timm or torchvision name."""
    path = Path(model).expanduser()
    if path.exists():
        kind = "onnx" if path.suffix == ".onnx" else "program" if path.suffix == ".pt2" else "checkpoint"
        return kind, str(path)
    if pretrained:
        return "name", model
    raise UsageError(f"{model} is not a file or folder; give a checkpoint, a saved model folder, an ONNX file or an "
                     "int8 .pt2, or a timm name with --pretrained")


def load_predictor(source: tuple[str, str], options: dict[str, Any], threads: int | None = None):
    """(the task's predictor of ``source``, the task's name); ``threads``: the intra-op threads it runs on."""
    from vitkit.tasks import registry

    kind, value = source
    if threads:
        import torch

        torch.set_num_threads(threads)
    if kind == "onnx":
        from vitkit.deploy.onnx_model import OnnxModel

        net = OnnxModel(value, threads=threads)
        task = registry.for_onnx(net.meta)
        return task.function("predictor")(("onnx", net), options), task.name
    if kind == "program":
        from vitkit.deploy.quantize_program import load_int8_program

        program = load_int8_program(value)
        task = registry.for_onnx(program.meta)
        return task.function("predictor")(("program", program), options), task.name
    import vitkit.lit  # noqa: F401 - the class paths checkpoints record (Lightning loads only imported classes)

    task = registry.for_file(value, "predictor") if kind == "checkpoint" else registry.other_files()
    return task.function("predictor")((kind, value), options), task.name
