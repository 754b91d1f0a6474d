"""The task protocol: what a task package declares once, and what every command reads from it.

A task package (``vitkit/tasks/<name>/``, or any installed package that names itself under the ``vitkit.tasks`` entry
point group) holds a ``task`` module with one :class:`Task`. ``vitkit train`` links its data to its module by it,
and ``vitkit predict``, ``evaluate``, ``export`` and ``serve`` find the task of a file by it (a checkpoint by the
Lightning module it records, an ONNX file by its ``vitkit.task`` metadata) and call the task's own functions. No
command names a task's classes; ``registry.py`` finds the tasks.

A task's functions are named as ``"module:function"`` strings, imported when a command needs them, so that finding
a task costs no import of torch or Lightning (``vitkit --help`` stays fast)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class Prediction:
    """One image's result, as every command shows it: ``line`` (what ``vitkit predict`` prints after the image's
    name), ``record`` (plain JSON values: what a server answers), and ``files`` (name suffix -> bytes, PNG for a
    picture, written beside each other by ``vitkit predict -o``)."""

    line: str
    record: dict[str, Any]
    files: dict[str, bytes] = field(default_factory=dict)


def png_bytes(image) -> bytes:
    """A PIL image as the PNG bytes of a :class:`Prediction`'s files."""
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


class Predictor(Protocol):
    """A loaded model and its preprocessing, for one image at a time or a batch. ``prepare`` turns a decoded image
    into the model's input exactly as evaluation prepares it (the size, crop, mean and std the model records);
    ``run`` is one forward of prepared inputs stacked in a batch (or one at a time where the inputs' shapes differ);
    ``result`` reads one output, of the image given, as a :class:`Prediction`.

    What a server answers besides the record, a predictor says by optional attributes: ``draws_overlay`` (True: its
    files hold a picture, ``overlay_file``, default ``_overlay.png``, answered to ``format=overlay``) and
    ``served_files`` (file suffix -> the JSON answer's key: those files, as base64, beside the record)."""

    names: list[str]

    def prepare(self, image: Any) -> Any: ...

    def run(self, prepared: Sequence[Any]) -> list[Any]: ...

    def result(self, image: Any, output: Any, options: dict[str, Any]) -> Prediction: ...


@dataclass(frozen=True)
class Task:
    """What a task declares.

    Args:
        name: the task's name (``classification``, ``segmentation``): an exported file's ``vitkit.task`` metadata.
        modules: the class paths of its Lightning modules, as checkpoints record them (``vitkit.lit.Segmenter``);
            the first is the task's own.
        links: what its module takes from the data module once that is built: the data module's attribute -> the
            module's argument (``{"num_classes": "num_classes"}``).
        predictor: ``"module:function"``: (a model file, its source kind ``checkpoint``/``onnx``/``name``, and the
            command's options) -> a :class:`Predictor`.
        evaluate: ``"module:function"``: (the parsed ``vitkit evaluate`` config, the data module's builder, the
            device) -> the command's exit status; it writes the report.
        export_model: ``"module:function"``: (a checkpoint path, overrides) -> the model to export (an ``nn.Module``
            with ``cfg``, ``name`` and ``class_names``).
        other_files: whether the task reads model files that record no task (a timm tag, a bare state dict): the
            classifier's.
        onnx_kinds: the ``vitkit.task`` values of its exports besides ``name`` (an export of before the metadata
            said which).
        data_module: the class path of the data module ``vitkit evaluate --data.root DIR`` means for its models
            (without one, the classifier's image folder).
        int8_gate: ``"module:function"``: (an fp32 export, ``OnnxModel``) -> what ``vitkit export --int8 --calibrate
            DIR`` scores fp32 against int8 by (``vitkit.deploy.quantize.TopOne`` says how); without one, its exports
            are not quantized.
        claims: ``"module:function"``: (a path that is not a Lightning checkpoint) -> whether it is one of the task's
            models of another library (a transformers folder of its ``model_type``, another library's file): its
            commands then read it as they read the task's checkpoints.
    """

    name: str
    modules: tuple[str, ...]
    links: dict[str, str] = field(default_factory=dict)
    predictor: str | None = None
    evaluate: str | None = None
    export_model: str | None = None
    other_files: bool = False
    onnx_kinds: tuple[str, ...] = ()
    data_module: str | None = None
    int8_gate: str | None = None
    claims: str | None = None

    def function(self, which: str) -> Callable:
        """The task's function ``which`` (``predictor``, ``evaluate``, ``export_model``, ``claims``), imported."""
        path = getattr(self, which)
        if path is None:
            from vitkit.errors import UsageError

            raise UsageError(f"the {self.name} task has no {which.replace('_', ' ')}")
        module, _, name = path.partition(":")
        return getattr(importlib.import_module(module), name)


def lazy_names(package: str, where: dict[str, str]) -> tuple[list[str], Callable[[str], Any]]:
    """A task package's ``__all__`` and ``__getattr__``: each name imported from its module (``where``: name ->
    ``.module``) when first asked for, so that finding the task (its ``task`` module) imports neither torch nor
    Lightning."""
    def getattr_(name: str) -> Any:
        if name in where:
            return getattr(importlib.import_module(where[name], package), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return sorted(where), getattr_


def folder_model_type(path: str) -> str | None:
    """The ``model_type`` of a transformers folder's ``config.json`` at ``path``; None for anything else."""
    import json
    from pathlib import Path

    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    try:
        return json.loads(config.read_text()).get("model_type")
    except (ValueError, AttributeError):
        return None
