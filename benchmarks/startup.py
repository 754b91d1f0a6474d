"""How long a command takes to start and answer: `vitkit predict IMG --onnx model.onnx` beside a bare onnxruntime
script that does the same (open, resize, crop, normalise, run, softmax), and `--help` of every subcommand. Each
entry is a fresh interpreter, run in turn round by round (so load drifts hit all alike); the median wall time of the
rounds is reported, with which of torch and Lightning the command imported. The help of ``train`` and ``evaluate``
is timed the first time (an empty help cache, ``vitkit/cli/help_cache.py``: their plain forms ship with vitkit) and
after; so is a help that does not ship (``--model.help CLASS``), which the first time needs Lightning.

    python benchmarks/startup.py --rounds 5 --out benchmarks/results/startup_cpu.md
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BARE = """
import sys, numpy as np, onnxruntime as ort
from PIL import Image
s = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
_, c, h, w = s.get_inputs()[0].shape
h, w = (h, w) if isinstance(h, int) else (32, 32)
img = Image.open(sys.argv[2]).convert("RGB").resize((w, h), Image.BICUBIC)
x = ((np.asarray(img, np.float32) / 255 - 0.5) / 0.5).transpose(2, 0, 1)[None]
logits = s.run(None, {s.get_inputs()[0].name: x})[0][0]
p = np.exp(logits - logits.max()); p /= p.sum()
print(int(p.argmax()), float(p.max()))
"""
PROBE = """
import runpy, sys
sys.argv = ["vitkit", *sys.argv[1:]]
code = 0
try:
    runpy.run_module("vitkit.cli", run_name="__main__")
except SystemExit as e:
    code = e.code or 0
print("imported:", ",".join(m for m in ("torch", "lightning") if m in sys.modules) or "neither", file=sys.stderr)
sys.exit(code)
"""


def _model(folder: Path) -> tuple[Path, Path]:
    import torch
    from PIL import Image

    import vitkit
    from vitkit.deploy.export import export_onnx

    torch.manual_seed(0)
    model = vitkit.create_model("vit_tiny_patch16_224", img_size=32, num_classes=10, depth=2).eval()
    export_onnx(model, folder / "model.onnx")
    Image.new("RGB", (48, 40), (120, 30, 200)).save(folder / "a.png")
    return folder / "model.onnx", folder / "a.png"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None, help="a markdown table (printed too)")
    args = ap.parse_args()
    from vitkit.cli import COMMANDS
    from vitkit.cli.help_cache import CACHED

    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"  # the help of train and evaluate: the first time (emptied), then from it
        env = {**os.environ, "VITKIT_CACHE": str(cache)}
        onnx, image = _model(Path(tmp))
        entries = {"bare onnxruntime script": [sys.executable, "-c", BARE, str(onnx), str(image)],
                   "vitkit predict IMG --onnx": [sys.executable, "-c", PROBE, "predict", str(image), "--onnx",
                                                 str(onnx)],
                   "vitkit --help": [sys.executable, "-c", PROBE, "--help"]}
        for name in COMMANDS:
            sub = ["train", "fit", "--help"] if name == "train" else [name, "--help"]
            if name in CACHED:
                entries[f"vitkit {' '.join(sub)}, the first time"] = [sys.executable, "-c", PROBE, *sub]
            entries[f"vitkit {' '.join(sub)}"] = [sys.executable, "-c", PROBE, *sub]
        other = ["train", "fit", "--model.help", "vitkit.lit.ImageClassifier"]
        entries[f"vitkit {' '.join(other)}, the first time"] = [sys.executable, "-c", PROBE, *other]
        entries[f"vitkit {' '.join(other)}"] = [sys.executable, "-c", PROBE, *other]
        times: dict[str, list[float]] = {k: [] for k in entries}
        imported: dict[str, str] = {}
        for _ in range(args.rounds):
            for name, cmd in entries.items():
                if name.endswith("the first time"):
                    shutil.rmtree(cache, ignore_errors=True)
                start = time.perf_counter()
                done = subprocess.run(cmd, capture_output=True, text=True, env=env)
                times[name].append(time.perf_counter() - start)
                if done.returncode != 0:
                    raise SystemExit(f"{name} failed: {done.stderr[-2000:]}")
                said = [line for line in done.stderr.splitlines() if line.startswith("imported: ")]
                imported[name] = said[-1].removeprefix("imported: ") if said else "-"
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               "unknown CPU")
    rows = [f"CPU: {cpu}; {args.rounds} rounds, median (min-max) seconds of a fresh interpreter", "",
            "| command | median s | min-max | imports |", "|---|---|---|---|"]
    for name, ts in times.items():
        rows.append(f"| {name} | {statistics.median(ts):.2f} | {min(ts):.2f}-{max(ts):.2f} | {imported[name]} |")
    text = "\n".join(rows) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
