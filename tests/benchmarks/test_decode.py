"""The decoding benchmark: a tiny run writes every output, and both rows decode the same token count."""

import csv
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("decode_bench", ROOT / "benchmarks" / "decode.py")
decode = importlib.util.module_from_spec(spec)
spec.loader.exec_module(decode)


def test_smoke_run_writes_csv_json_and_markdown(tmp_path):
    out = tmp_path / "dec.csv"
    rows = decode.main(["--model", "transformer_tiny", "--vocab", "50", "--batch-size", "2", "--src-len", "5",
                        "--new-tokens", "12", "--rounds", "1", "--out", str(out)])
    assert [r["cache"] for r in rows] == [True, False]
    assert all(r["tokens_per_s"] > 0 and r["new_tokens"] == 12 for r in rows)
    assert list(next(csv.DictReader(out.open()))) == decode.COLUMNS
    assert out.with_suffix(".json").exists() and "speedup_vs_uncached" in out.with_suffix(".md").read_text()
