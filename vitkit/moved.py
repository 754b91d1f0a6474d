"""Old module paths, kept importable: ``vitkit.tools.export`` is ``vitkit.deploy.export`` (the same module object),
imported on first use with a FutureWarning that names the new path, as timm does for ``timm.models.layers``."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

MOVED = {
    **{f"vitkit.tools.{m}": f"vitkit.deploy.{m}"
       for m in ("export", "export_packed", "onnx_model", "quantize", "quantize_program")},
    **{f"vitkit.tools.{m}": f"vitkit.benchmarking.{m}" for m in ("bench", "timing", "flops", "merging")},
    "vitkit.tools.plots": "vitkit.evaluation.plots",
    "vitkit.tools.masks": "vitkit.masks",
    "vitkit.lora": "vitkit.checkpoints.adapters",
    "vitkit.budget": "vitkit.patch_budget",
    "vitkit.noise": "vitkit.library_output",
}
OLD_PACKAGES = {"vitkit.tools"}  # packages that are gone; their modules above live on


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path in :data:`MOVED` and gives the module at its new one."""

    def find_spec(self, name, path=None, target=None):
        if name in MOVED or name in OLD_PACKAGES:
            return importlib.util.spec_from_loader(name, self, is_package=name in OLD_PACKAGES)
        return None

    def create_module(self, spec):
        if spec.name in OLD_PACKAGES:
            module = types.ModuleType(spec.name, f"Moved: its modules are {sorted(MOVED)}.")
            module.__path__ = []
            return module
        warnings.warn(f"{spec.name} moved to {MOVED[spec.name]}; import it from there", FutureWarning, stacklevel=2)
        module = importlib.import_module(MOVED[spec.name])
        self._own = (module, module.__spec__, module.__loader__)
        return module

    def exec_module(self, module):
        # the import system gave the module the old name's spec and loader; it keeps its own
        if getattr(self, "_own", (None,))[0] is module:
            _, module.__spec__, module.__loader__ = self._own


def install() -> None:
    """Puts the finder on ``sys.meta_path`` once."""
    if not any(isinstance(f, MovedModules) for f in sys.meta_path):
        sys.meta_path.append(MovedModules())
