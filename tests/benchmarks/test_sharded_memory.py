"""The sharded-memory benchmark: a tiny run on 2 CPU processes writes every output, and each FSDP2 rank holds at
most 0.55x of what a DDP rank holds."""

import csv
from pathlib import Path

import pytest

from tests import forkserver

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_fsdp2_ranks_hold_half_of_what_ddp_ranks_hold(tmp_path):
    out = tmp_path / "mem.csv"
    run = forkserver.run(["benchmarks/sharded_memory.py", "--models", "vit_tiny_patch16_224", "--img-size", "32",
                          "--out", str(out)], cwd=ROOT, timeout=280)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = list(csv.DictReader(out.open()))
    assert [(r["strategy"], r["rank"]) for r in rows] == [("ddp", "0"), ("ddp", "1"), ("fsdp2", "0"), ("fsdp2", "1")]
    for r in rows[2:]:
        assert float(r["state_vs_ddp"]) <= 0.55 and float(r["params_mb"]) > 0 and float(r["optimizer_mb"]) > 0
    assert out.with_suffix(".json").exists() and "state_vs_ddp" in out.with_suffix(".md").read_text()
