"""``vitkit bench``: img/s, GMACs, MFU and peak memory of vitkit presets beside timm and torchvision, measured in
one process (``vitkit/benchmarking/bench.py``); with ``--checkpoint``, the token-merging curve of a trained ViT."""

from __future__ import annotations

import argparse
from pathlib import Path

from .common import command_parser


def parser() -> argparse.ArgumentParser:
    """The options; torch is imported when they are checked (:func:`parse_args`), not for ``--help``."""
    p = command_parser("bench")
    p.add_argument("--models", type=lambda s: s.split(","), default=["vit_base_patch16_224"])
    p.add_argument("--peers", default="timm,torchvision",
                   help="comma-separated: timm, torchvision, onnxruntime (vitkit's ONNX export; float32 inference on "
                        "the CPU), or ''")
    p.add_argument("--mode", choices=["infer", "train", "both"], default="infer")
    p.add_argument("--batch-sizes", type=lambda s: [int(b) for b in s.split(",")], default=[16])
    p.add_argument("--precision", default="fp32", help="fp32, bf16, amp_bf16 or fp16")
    p.add_argument("--attn-backend", choices=["auto", "sdpa", "math", "flex"], default="auto")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--grad-checkpointing", action="store_true",
                   help="set_grad_checkpointing(True) on every model (vitkit, timm): training memory for time")
    p.add_argument("--token-merging", type=lambda s: [int(r) for r in s.split(",")], default=[0],
                   help="comma-separated ToMe r values (token pairs merged per block): one vitkit row each, beside "
                        "vitkit unmerged (0) and the peers; ViT/DeiT presets only")
    p.add_argument("--checkpoint", help="a trained ViT checkpoint: instead of the throughput table, the token-merging "
                   "curve (img/s, GMACs, top-1 on its validation data for each --token-merging value) and its plot")
    p.add_argument("--val-dir", help="with --checkpoint, for checkpoints that record no data module: a folder of "
                   "class folders (an ImageNet-style val/)")
    p.add_argument("--device", default=None, help="default: cuda where there is one, else cpu")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    p.add_argument("--iters", type=int, default=3, help="timed steps per entry per round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-mem", dest="mem", action="store_false", help="skip the peak-memory measurement")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads on CPU")
    p.add_argument("--out", type=Path, default=None,
                   help="CSV path (default bench/throughput.csv, or bench/token_merging.csv with --checkpoint); the "
                        "JSON, markdown and PNG are written beside it")
    p.add_argument("--_mem-probe", dest="_mem_probe", default=None, help=argparse.SUPPRESS)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)  # first: --help answers without importing torch
    import torch

    import vitkit
    from vitkit.benchmarking.bench import PRECISIONS
    from vitkit.checkpoints.names import capabilities

    if args.precision not in PRECISIONS:
        p.error(f"argument --precision: invalid choice: {args.precision!r} (choose from {', '.join(PRECISIONS)})")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.mode = ["infer", "train"] if args.mode == "both" else [args.mode]
    unknown = [m for m in args.models if m not in vitkit.list_models()]
    if unknown:
        p.error(f"unknown vitkit preset(s) {unknown}; see vitkit.list_models()")
    not_vit = [m for m in args.models if any(args.token_merging) and not capabilities(m).token_merging]
    if not_vit:
        p.error(f"--token-merging is for ViT/DeiT presets only (Swin keeps a fixed token grid): {not_vit}")
    return args


def measure(argv: list[str] | None = None) -> list[dict]:
    """The table's rows (or the token-merging curve's) for a command line's arguments, written where ``--out``
    says."""
    args = parse_args(argv)
    import torch

    from vitkit.benchmarking.bench import markdown_table, mem_probe, run, write_outputs

    if args.threads:
        torch.set_num_threads(args.threads)
    if args._mem_probe:
        mem_probe(args)
        return []
    torch.manual_seed(0)
    if args.checkpoint:
        return merging_curve(args)
    args.out = args.out or Path("bench/throughput.csv")
    rows = run(args)
    write_outputs(rows, args.out)
    print(markdown_table(rows))
    print(f"wrote {args.out} (+ .json, .md, .png)")
    return rows


def merging_curve(args) -> list[dict]:
    from vitkit.benchmarking import merging
    from vitkit.benchmarking.bench import write_rows

    out = args.out or Path("bench/token_merging.csv")
    rows = merging.curve(args)
    write_rows(rows, out, merging.COLUMNS)
    out.with_suffix(".md").write_text(merging.markdown(rows))
    merging.plot(rows, out.with_suffix(".png"), f"token merging: {rows[0]['model']} ({Path(args.checkpoint).name})\n"
                 f"batch {rows[0]['batch_size']}, {rows[0]['device']}")
    print(merging.markdown(rows))
    print(f"wrote {out} (+ .json, .md, .png)")
    return rows




def main(argv: list[str] | None = None) -> int:
    measure(argv)
    return 0
