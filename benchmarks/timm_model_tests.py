"""Run timm's own model tests (``tests/test_models.py`` of a timm checkout) on vitkit's models.

timm's test module is run as it is, with one change made from outside: its ``create_model`` is vitkit's. Only
the items whose ``model_name`` is one of ``--presets`` are kept, so each of timm's checks (forward, backward,
default cfgs, TorchScript, fx forward and backward, features, forward_intermediates) runs on vitkit's model of
the same name. timm's own skip rules (input-size limits) apply unchanged.

    git clone https://github.com/huggingface/pytorch-image-models /tmp/timm
    python benchmarks/timm_model_tests.py /tmp/timm/tests/test_models.py -n 2

Prints pytest's summary; extra arguments go to pytest (``-k fx``, ``-x``, ``-n 2`` with pytest-xdist).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PRESETS = ("vit_tiny_patch16_224", "deit_tiny_patch16_224", "vit_small_patch16_224", "vit_base_patch16_reg4_gap_256",
           "swin_tiny_patch4_window7_224", "deit3_small_patch16_224")

CONFTEST = '''
import os

import pytest

import vitkit

PRESETS = os.environ["VITKIT_PRESETS"].split(",")


def pytest_collection_modifyitems(config, items):
    items[:] = [i for i in items if getattr(i, "callspec", None) and i.callspec.params.get("model_name") in PRESETS]


@pytest.fixture(autouse=True)
def _vitkit_create_model(monkeypatch):
    import test_models

    monkeypatch.setattr(test_models, "create_model", vitkit.create_model)
'''

PYTEST_INI = """[pytest]
markers =
    base
    cfg
    torchscript
    features
    fxforward
    fxbackward
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("test_models", type=Path, help="tests/test_models.py of a timm checkout")
    parser.add_argument("--presets", default=",".join(PRESETS), help="comma-separated vitkit presets")
    args, pytest_args = parser.parse_known_args(argv)
    if not args.test_models.is_file():
        parser.error(f"{args.test_models}: expected timm's tests/test_models.py, found no file there")
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(args.test_models, Path(tmp) / "test_models.py")
        (Path(tmp) / "conftest.py").write_text(CONFTEST)
        (Path(tmp) / "pytest.ini").write_text(PYTEST_INI)
        env = {**os.environ, "VITKIT_PRESETS": args.presets}
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", "test_models.py",
               *pytest_args]
        return subprocess.run(cmd, cwd=tmp, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
