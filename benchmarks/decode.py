"""Tokens/s of encoder-decoder decoding, with and without the KV cache, measured in one process.

Each round decodes the same batch once with the cache and once without, so drift hits both alike;
the figure is the median over rounds. The end-of-sequence id is set outside the vocabulary so every
run decodes exactly ``--new-tokens`` tokens.

    python benchmarks/decode.py --model transformer_base --batch-size 8 --src-len 32 --new-tokens 128 \
        --out benchmarks/results/transformer_base_decode_cpu.csv

Writes the CSV and, beside it, the same rows as JSON and a markdown table.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch

import vitkit
from vitkit.benchmarking.bench import write_rows

COLUMNS = ["model", "batch_size", "src_len", "new_tokens", "beam_size", "cache", "tokens_per_s", "tokens_per_s_min",
           "tokens_per_s_max", "ms_per_token", "speedup_vs_uncached", "device", "torch"]


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="transformer_base")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--src-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--beam-size", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="benchmarks/results/decode.csv")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = vitkit.create_model(a.model, src_vocab_size=a.vocab, tgt_vocab_size=a.vocab,
                                eos_id=a.vocab).eval().to(a.device)  # an id never produced: no early stop
    src = torch.randint(3, a.vocab, (a.batch_size, a.src_len), device=a.device)

    def run(cache: bool) -> float:
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = model.generate(src, max_len=a.new_tokens, beam_size=a.beam_size, use_cache=cache)
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()
        assert out.shape[1] == a.new_tokens
        return time.perf_counter() - t

    run(True), run(False)  # warm-up
    times = {True: [], False: []}
    for _ in range(a.rounds):
        for cache in (True, False):
            times[cache].append(run(cache))
    rows = []
    n = a.batch_size * a.new_tokens
    for cache in (True, False):
        med = statistics.median(times[cache])
        rows.append(dict(model=a.model, batch_size=a.batch_size, src_len=a.src_len, new_tokens=a.new_tokens,
                         beam_size=a.beam_size, cache=cache, tokens_per_s=round(n / med, 1),
                         tokens_per_s_min=round(n / max(times[cache]), 1),
                         tokens_per_s_max=round(n / min(times[cache]), 1),
                         ms_per_token=round(1e3 * med / a.new_tokens, 2),
                         speedup_vs_uncached=round(statistics.median(times[False]) / med, 2),
                         device=torch.cuda.get_device_name() if a.device.startswith("cuda") else platform.processor()
                         or platform.machine(), torch=torch.__version__))
    out = Path(a.out)
    write_rows(rows, out, COLUMNS)
    head = ["model", "batch_size", "new_tokens", "beam_size", "cache", "tokens_per_s", "ms_per_token",
            "speedup_vs_uncached"]
    md = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    md += ["| " + " | ".join(str(r[c]) for c in head) + " |" for r in rows]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return rows


if __name__ == "__main__":
    main()
