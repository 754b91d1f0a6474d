import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from sklearn.datasets import load_digits

ROOT = Path(__file__).resolve().parents[2]
TINY_VIT = '{"depth": 1, "embed_dim": 32, "num_heads": 2, "patch_size": 8}'


@pytest.fixture(autouse=True)
def _offline_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")


@pytest.fixture(scope="session")
def image_folder(tmp_path_factory) -> Path:
    """A real ImageNet-layout folder: digits written as PNG and JPEG files, 3 classes."""
    root = tmp_path_factory.mktemp("imagefolder")
    digits = load_digits()
    for split, start in (("train", 0), ("val", 900)):
        for cls in (0, 1, 2):
            d = root / split / f"class_{cls}"
            d.mkdir(parents=True)
            idx = np.flatnonzero(digits.target == cls)
            idx = idx[idx >= start][:6]
            for k, i in enumerate(idx):
                img = Image.fromarray((digits.images[i] * 15).astype(np.uint8)).resize((40, 40)).convert("RGB")
                img.save(d / f"{i}.{'png' if k % 2 else 'jpg'}")
    return root


@pytest.fixture(scope="session")
def image_shards(image_folder, tmp_path_factory) -> Path:
    """``image_folder`` converted by ``vitkit prepare-data``."""
    from vitkit.shards import prepare_data

    out = tmp_path_factory.mktemp("shards") / "out"
    prepare_data(image_folder, out, workers=2)
    return out


def run_in_repo(args, **kw):
    import subprocess
    import sys

    env = dict(os.environ, **kw.pop("env", {}))
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, **kw)
