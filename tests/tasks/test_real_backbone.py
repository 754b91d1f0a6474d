"""Depth learned from the real DINOv2 ViT-S/14 on real digits (``../shared/real``): ``depth_finetune_small_data``
beats a ridge regression on the same frozen tokens, both scored by Eigen's errors on the same held-out scenes.

The scenes, the baseline and the run are ``benchmarks/depth_real.py``'s, smaller (120 training scenes, 8 epochs of 8):
its full run and figures are in docs/depth.md. CI's machine starts without the real files, so the test is skipped
where ``~/.cache/vitkit-real`` lacks them (``python ../shared/real/prepare.py`` writes them).
"""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
REAL = Path.home() / ".cache" / "vitkit-real"
DINO, MNIST = REAL / "dino_s14.safetensors", REAL / "mnist_5k.npz"

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not (DINO.exists() and MNIST.exists()),
                                                   reason=f"{REAL} lacks the real files: ../shared/real/prepare.py")]


def _benchmark(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_bench", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_depth_from_the_real_dinov2_beats_a_ridge_regression_on_its_frozen_tokens(tmp_path):
    bench = _benchmark("depth_real")
    digits, size = np.load(MNIST)["x"], 112
    rng = np.random.default_rng(7)
    order = rng.permutation(len(digits))
    train = bench.scenes(digits[order[:4000]], 120, size, rng)
    val = bench.scenes(digits[order[4000:]], 40, size, rng)  # digits training never saw
    bench.write_split(tmp_path / "scenes", "train", train)
    bench.write_split(tmp_path / "scenes", "val", val)
    base = bench.baseline(train, {"val": val}, DINO, size)["val"]
    tuned = bench.fine_tune(tmp_path / "scenes", DINO, size, 8, 8, tmp_path / "run", "depth_finetune_small_data",
                            ["val"])["val"]
    assert tuned["samples"] == 40, tuned
    # lower AbsRel by a tenth of the baseline's at least, and more pixels within 1.25 of the truth
    assert tuned["AbsRel"] < 0.9 * base["AbsRel"] and tuned["delta1"] > base["delta1"], (base, tuned)
