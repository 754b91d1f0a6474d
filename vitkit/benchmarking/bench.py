"""Throughput of vitkit presets side by side with timm and torchvision, measured in one process.

Each round runs every entry (library x model x mode x batch size) for a few timed steps in turn, so
that clock and load drift hit all of them alike; img/s is the median over the timed steps after
warm-up (CUDA-synchronised on GPU), with min and max. GMACs come from torch.utils.flop_counter on the
meta device; MFU compares achieved FLOP/s with a matmul probe on the same device and dtype.

    vitkit bench --models vit_base_patch16_224 --peers timm,torchvision \
        --mode infer --batch-sizes 16 --precision fp32 --out benchmarks/results/vit_b16_cpu.csv

(its arguments: ``vitkit/cli/bench.py``; ``python benchmarks/throughput.py ...`` in a source checkout is the same
program.)

Writes the CSV and, beside it, the same rows as JSON, a markdown table and a PNG chart.
"""

from __future__ import annotations

import csv
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import vitkit
from vitkit.benchmarking.flops import count_gmacs_of, count_params
from vitkit.benchmarking.timing import Entry, prepare, sync, time_rounds, warm_up
from vitkit.checkpoints.formats import to_vitkit
from vitkit.checkpoints.hub import TORCHVISION_MODELS
from vitkit.models.config import pair

# vitkit preset -> torchvision builder name, for the architectures torchvision has
TORCHVISION = {preset: builder for builder, preset in TORCHVISION_MODELS.items()}
PRECISIONS = ("fp32", "bf16", "amp_bf16", "fp16")
COLUMNS = ["library", "model", "mode", "batch_size", "precision", "attn_backend", "compile", "channels_last",
           "grad_checkpointing", "token_merging",
           "img_per_s", "img_per_s_min", "img_per_s_max", "step_ms", "peak_mem_mb", "params_m", "gmacs",
           "mfu", "peak_tflops", "oom_backoff", "device", "torch"]


def build_factories(name: str, peers: list[str], attn_backend: str,
                    token_merging: int = 0) -> list[tuple[str, Callable[[], nn.Module]]]:
    """Each library's model of the preset with a 1000-class head (backbone presets, CLIP's projection: a classifier
    head like the others', so that the training step is the same). Beside timm, vitkit's model runs the same random
    weights as timm's (seed 0 for both): CPU speed depends on the values (denormal floats), and two draws of the
    same initialisation measured up to 5% apart on ViT-B/16 (a gap that ``torch.set_flush_denormal`` closes)."""
    def ours() -> nn.Module:
        model = vitkit.create_model(name, attn_backend=attn_backend, num_classes=1000)
        if twin is not None:
            model.load_state_dict(to_vitkit(twin().state_dict())[0])
        if token_merging:
            model.set_token_merging(token_merging)
        return model

    twin = None
    if "timm" in peers:
        import timm

        if name in timm.list_models():
            def twin() -> nn.Module:
                torch.manual_seed(0)
                return timm.create_model(name, pretrained=False, num_classes=1000)

    out = [("vitkit", ours)] + ([("timm", twin)] if twin is not None else [])
    if "torchvision" in peers and name in TORCHVISION:
        import torchvision

        out.append(("torchvision", lambda: getattr(torchvision.models, TORCHVISION[name])()))
    if "onnxruntime" in peers:
        out.append(("onnxruntime", lambda: OnnxRuntimeModule(name)))
    return out


class OnnxRuntimeModule(nn.Module):
    """vitkit's model exported to ONNX (fixed size, dynamic batch) and run by onnxruntime on the CPU, with the
    threads torch has; inference in float32 only."""

    def __init__(self, name: str, **overrides) -> None:
        super().__init__()
        import tempfile

        from vitkit.deploy.export import OnnxModel, export_onnx

        self._dir = tempfile.TemporaryDirectory()
        path = Path(self._dir.name) / f"{name}.onnx"
        export_onnx(vitkit.create_model(name, **overrides).eval(), path, dynamic_size=False)
        self.session = OnnxModel(path, threads=torch.get_num_threads())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self.session(x.numpy()))


def matmul_peak_tflops(device: torch.device, precision: str) -> float:
    """Peak FLOP/s of the linear layers this device and dtype can reach: the best of a few large
    ``F.linear`` shapes like a transformer's (the MFU denominator). ``F.linear`` rather than ``a @ b``:
    on CPUs without native bf16 the latter takes a path ~50x slower than the one models use."""
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16 if "bf16" in precision else torch.float16
    shapes = [(8192, 8192, 8192)] if device.type == "cuda" else [(4096, 1024, 1024), (3152, 768, 3072),
                                                                   (2048, 2048, 2048)]
    best = 0.0
    for m, k, n in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        w = torch.randn(n, k, device=device, dtype=dtype)
        for _ in range(4):
            sync(device)
            t0 = time.perf_counter()
            nn.functional.linear(a, w)
            sync(device)
            best = max(best, 2 * m * k * n / (time.perf_counter() - t0))
    return best / 1e12


def peak_mem_mb(e: Entry, args, device: torch.device) -> float:
    """Peak memory of a step, weights and optimizer state included: CUDA's allocator peak on GPU; on
    CPU the resident-set high-water mark of a fresh child process that builds the model and runs two
    steps (in a shared process the other entries' memory would blur it)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        e.step()
        sync(device)
        return torch.cuda.max_memory_allocated(device) / 2**20
    cmd = [sys.executable, "-m", "vitkit.cli", "bench", "--_mem-probe", e.library, "--models", e.model,
           "--mode", e.mode, "--batch-sizes", str(e.batch_size), "--precision", args.precision,
           "--attn-backend", args.attn_backend,
           "--peers", e.library, "--token-merging", str(e.token_merging)] + \
        (["--grad-checkpointing"] if args.grad_checkpointing else [])
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    try:
        return float(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return float("nan")


def _proc_status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def mem_probe(args) -> None:
    """Child process: resident memory added by building the model and running two steps (MiB)."""
    device = torch.device("cpu")
    r = args.token_merging[0]
    factory = dict(build_factories(args.models[0], [args._mem_probe], args.attn_backend, r))[args._mem_probe]
    e = Entry(args._mem_probe, args.models[0], args.mode[0], args.batch_sizes[0], factory, token_merging=r)
    with torch.device("meta"):  # what building it imports is not the model's memory (vitkit reads timm's pretrained
        factory()               # config, and timm brings torchvision and PIL: ~60 MiB): imported before the count
    Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark (VmHWM) to the current RSS
    before = _proc_status_kib("VmRSS")
    prepare(e, args, device)
    e.step()
    e.step()
    print((_proc_status_kib("VmHWM") - before) / 1024)


def build_entries(args, device: torch.device) -> tuple[list[Entry], dict[tuple[str, int], float]]:
    """Every (library, model, mode, batch size) to time, vitkit's once per ``--token-merging`` value, and the
    GMACs of each model (and of each merging value) from the FLOP counter."""
    peers = [p for p in args.peers.split(",") if p]
    entries: list[Entry] = []
    gmacs: dict[tuple[str, int], float] = {}
    for name in args.models:
        cfg = vitkit.get_config(name)
        shape = (cfg.in_chans, *pair(cfg.img_size))
        for r in args.token_merging:
            gmacs[(name, r)] = count_gmacs_of(
                lambda n=name, r=r: vitkit.create_model(n, num_classes=1000, **({"token_merging": r} if r else {})),
                shape)
        ours = [("vitkit", dict(build_factories(name, peers, args.attn_backend, r))["vitkit"], r)
                for r in args.token_merging]  # vitkit once per merging value, the peers once
        theirs = [(lib, f, 0) for lib, f in build_factories(name, peers, args.attn_backend) if lib != "vitkit"]
        for lib, factory, r in ours + theirs:
            for mode in args.mode:
                if lib == "onnxruntime" and (mode == "train" or args.precision != "fp32" or device.type != "cpu"
                                             or args.compile or args.channels_last):
                    print(f"onnxruntime: {mode} {args.precision}{' compiled' if args.compile else ''} on "
                          f"{device.type} is not measured (it runs float32 inference on the CPU)", file=sys.stderr)
                    continue
                for bs in args.batch_sizes:
                    entries.append(Entry(lib, name, mode, bs, factory, shape, token_merging=r))
    return entries, gmacs


def run(args) -> list[dict]:
    device = torch.device(args.device)
    entries, gmacs = build_entries(args, device)
    params: dict[tuple[str, str], float] = {}
    for e in entries:
        print(f"warm-up: {e.label:<12} {e.model} {e.mode} b{e.batch_size}", file=sys.stderr)
        warm_up(e, args, device)
        params[(e.library, e.model)] = count_params(e.net) / 1e6
    peak = matmul_peak_tflops(device, args.precision)
    time_rounds(entries, args, device)
    rows = []
    for e in entries:
        med = statistics.median(e.times)
        ips = e.batch_size / med
        macs = gmacs[(e.model, e.token_merging)]
        flops_per_img = macs * 2e9 * (3 if e.mode == "train" else 1)  # backward ~ 2x forward
        rows.append(dict(
            library=e.library, model=e.model, mode=e.mode, batch_size=e.batch_size, precision=args.precision,
            attn_backend=args.attn_backend if e.library == "vitkit" else "", compile=args.compile,
            channels_last=args.channels_last, grad_checkpointing=args.grad_checkpointing,
            token_merging=e.token_merging, img_per_s=round(ips, 3),
            img_per_s_min=round(e.batch_size / max(e.times), 3), img_per_s_max=round(e.batch_size / min(e.times), 3),
            step_ms=round(med * 1e3, 2), peak_mem_mb=round(peak_mem_mb(e, args, device), 1) if args.mem else "",
            params_m=round(params[(e.library, e.model)], 2), gmacs=round(macs, 3),
            mfu=round(ips * flops_per_img / (peak * 1e12), 4), peak_tflops=round(peak, 3),
            oom_backoff=e.oom_backoff, device=device_name(device), torch=torch.__version__))
        e.net = e.step = None
    return rows


def cpu_name() -> str:
    """The CPU's model name as ``lscpu`` gives it (Linux's /proc/cpuinfo), else what the platform module knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_name()} x{torch.get_num_threads()} threads"


def onnx_runner(path: str | Path, threads: int) -> Callable:
    """A function that runs the ONNX file at ``path`` in onnxruntime on the CPU (``threads`` intra-op threads) on one
    input array."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return lambda x: session.run(None, {name: x})


def interleaved_ms(entries: dict[str, Callable], x, rounds: int, iters: int, pause: float) -> dict[str, float]:
    """Each entry's median ms per call on ``x``: one warm-up call each, then ``rounds`` rounds in which every entry
    runs ``iters`` calls after ``pause`` idle seconds (a runtime's spinning threads then take nothing from the next)."""
    for run_one in entries.values():
        run_one(x)
    times: dict[str, list[float]] = {k: [] for k in entries}
    for _ in range(rounds):
        for name, run_one in entries.items():
            time.sleep(pause)
            start = time.perf_counter()
            for _ in range(iters):
                run_one(x)
            times[name].append(1000 * (time.perf_counter() - start) / iters)
    return {k: statistics.median(v) for k, v in times.items()}


def publish(text: str, out: Path | None) -> None:
    """A benchmark's result: printed, and written to ``out`` (its folder made) when given."""
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")


def write_rows(rows: list[dict], out: Path, columns: list[str]) -> None:
    """The rows as CSV at ``out`` and as JSON beside it (the decoding benchmark writes its rows the same way)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        w.writerows(rows)
    out.with_suffix(".json").write_text(json.dumps(rows, indent=2))


def write_outputs(rows: list[dict], out: Path) -> None:
    write_rows(rows, out, COLUMNS)
    out.with_suffix(".md").write_text(markdown_table(rows))
    chart(rows, out.with_suffix(".png"))


def markdown_table(rows: list[dict]) -> str:
    cols = ["model", "mode", "batch_size", "precision", "library", "token_merging", "img_per_s", "vs_best_peer",
            "vs_unmerged", "step_ms", "peak_mem_mb", "gmacs", "mfu"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        same = [p for p in rows if (p["model"], p["mode"], p["batch_size"]) == (r["model"], r["mode"], r["batch_size"])]
        peers = [p["img_per_s"] for p in same if p["library"] != "vitkit"]
        plain = [p["img_per_s"] for p in same if p["library"] == "vitkit" and not p.get("token_merging")]
        ours = r["library"] == "vitkit"
        rel = {"vs_best_peer": f"{r['img_per_s'] / max(peers):.2f}x" if peers and ours else "",
               "vs_unmerged": f"{r['img_per_s'] / plain[0]:.2f}x" if plain and ours and r.get("token_merging") else ""}
        lines.append("| " + " | ".join(str(rel[c] if c in rel else r.get(c, "")) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def chart(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["model"], r["mode"], r["batch_size"]) for r in rows}, key=str)
    label = lambda r: f"{r['library']} r={r['token_merging']}" if r.get("token_merging") else r["library"]  # noqa: E731
    libs = sorted({label(r) for r in rows}, key=lambda s: (not s.startswith("vitkit"), len(s), s))
    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(groups)), 4))
    width = 0.8 / len(libs)
    for i, lib in enumerate(libs):
        vals = [next((r["img_per_s"] for r in rows if label(r) == lib and (r["model"], r["mode"],
                      r["batch_size"]) == g), 0) for g in groups]
        bars = ax.bar([j + i * width for j in range(len(groups))], vals, width, label=lib)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks([j + width * (len(libs) - 1) / 2 for j in range(len(groups))])
    ax.set_xticklabels([f"{m}\n{mode} b{b}" for m, mode, b in groups], fontsize=7)
    ax.set_ylabel("images / s (median)")
    ax.set_title(f"{rows[0]['precision']} on {rows[0]['device']}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
