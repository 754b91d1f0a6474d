"""Where the commands find the tasks: every package under ``vitkit/tasks/`` that holds a ``task`` module, and every
installed package that names one under the ``vitkit.tasks`` entry point group (``[project.entry-points."vitkit.tasks"]
regression = "mypackage.task:TASK"``), each a :class:`~vitkit.tasks.protocol.Task`. Nothing here lists the tasks by
hand, and finding them imports neither torch nor Lightning."""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import pkgutil

from vitkit.errors import CheckpointError, UsageError, UsageTypeError

from .protocol import Task

GROUP = "vitkit.tasks"


@functools.cache
def tasks() -> dict[str, Task]:
    """Every task, by name: vitkit's own packages first, then the entry points'."""
    import vitkit.tasks as package

    found: dict[str, Task] = {}
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if info.ispkg and importlib.util.find_spec(f"{package.__name__}.{info.name}.task") is not None:
            _add(found, importlib.import_module(f"{package.__name__}.{info.name}.task").TASK, info.name)
    for point in importlib.metadata.entry_points(group=GROUP):
        _add(found, point.load(), f"the entry point {point.value}")
    return found


def _add(found: dict[str, Task], task: object, where: str) -> None:
    if not isinstance(task, Task):
        raise UsageTypeError(f"{where} declares {task!r}, not a vitkit.tasks.protocol.Task")
    if task.name in found:
        raise UsageError(f"two tasks are named {task.name!r} ({where} and an earlier one); a task's name is its own")
    found[task.name] = task


def links() -> dict[str, str]:
    """What a module takes from its data module, over every task: the data module's attribute -> the argument."""
    out: dict[str, str] = {}
    for task in tasks().values():
        out.update(task.links)
    return out


def for_module(class_path: str | None) -> Task | None:
    """The task whose Lightning module ``class_path`` names (``vitkit.lit.Segmenter``, or the class's own module
    path), or None."""
    if not class_path:
        return None
    name = class_path.rpartition(".")[2]
    for task in tasks().values():
        if class_path in task.modules:
            return task
    for task in tasks().values():  # another path to the same class (vitkit.lit.X and vitkit.tasks.x.module.X)
        if any(m.rpartition(".")[2] == name and _same_class(m, class_path) for m in task.modules):
            return task
    return None


def _same_class(a: str, b: str) -> bool:
    def load(path: str):
        module, _, name = path.rpartition(".")
        try:
            return getattr(importlib.import_module(module), name, None)
        except ImportError:
            return None

    return load(a) is not None and load(a) is load(b)


def for_checkpoint(path: str) -> Task:
    """The task of a model file: the one whose module a Lightning checkpoint records, else the task that reads the
    other files (a state dict, a saved model folder, a timm tag)."""
    from vitkit.training.hparams import read_hparams

    recorded = read_hparams(path).get("_class_path") if str(path).endswith(".ckpt") else None
    task = for_module(recorded)
    if task is not None:
        return task
    if recorded:
        raise CheckpointError(f"{path} is a checkpoint of {recorded}, which no vitkit task predicts, evaluates or "
                              f"exports (the tasks: {', '.join(tasks())})")
    for task in tasks().values():  # another library's model of a task (a transformers folder of its model_type)
        if task.claims is not None and task.function("claims")(str(path)):
            return task
    return other_files()


def for_file(path: str, which: str) -> Task:
    """The task that does ``which`` (``predictor``, ``evaluate``, ``export_model``) for a model file: its own, or, for a
    task that does not (a pre-training checkpoint, which holds a backbone), the task that reads any model file, whose
    refusal of a backbone says what to do with one."""
    task = for_checkpoint(path)
    return task if getattr(task, which) is not None else other_files()


def for_onnx(meta: dict) -> Task:
    """The task of an exported file, by its ``vitkit.task`` metadata (a classifier where it has none)."""
    kind = meta.get("task")
    if kind is None:
        return other_files()
    for task in tasks().values():
        if kind == task.name or kind in task.onnx_kinds:
            return task
    raise UsageError(f"the file is a {kind} model (its vitkit.task metadata), and no task installed here reads one "
                     f"(the tasks: {', '.join(tasks())})")


def other_files() -> Task:
    """The task that reads model files recording no task."""
    return next(task for task in tasks().values() if task.other_files)
