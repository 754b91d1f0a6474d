"""The whole training run, `vitkit train fit` beside timm's own train.py, on the same folder of JPEGs.

Both train the same model with the same recipe (AdamW, cosine, label smoothing 0.1; RandomResizedCrop and flips,
or with --augment on RandAugment, random erasing, mixup and cutmix as well), the same batch, workers and epochs,
then validate. Runs are interleaved (vitkit, timm, vitkit, timm, ...) so that a machine's drift falls on both.
Each run reports:

- ``first_step_s``: seconds from the command's start to the end of its first optimizer step (imports, model,
  data scan, worker start-up, the first batch);
- ``steady_img_s``: training images per second over the last epoch (its first step left out);
- ``wall_s``: the whole command; ``top1``: the last validation's top-1.

Then the loaders alone, in this process with no workers: CPU-seconds per training image for decode, augmentation
and collation (the figure that says how many accelerators one node's cores can feed), vitkit's training loader
against timm's (its prefetcher's transforms and ``fast_collate``), both ending at uint8 batches.

    python benchmarks/train_run.py --timm-train ../shared/peers/timm/train.py --sizes 64 224 --augment off on

The folder is the digits that ship with scikit-learn, upscaled to 256 px JPEGs (``--images`` of them, a fifth
held out for validation), or ``--root`` an ImageNet-style folder of your own.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import lightning as L

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TIMM = ROOT.parent / "shared/peers/timm/train.py"


class StepClock(L.Callback):
    """Appends the wall-clock time at the end of every training step to ``path`` (JSON lines): what timm's
    train.py prints at each logging interval, for vitkit's run."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"epoch": trainer.current_epoch, "step": batch_idx, "t": time.time(),
                                "n": len(batch[1])}) + "\n")


def write_folder(root: Path, images: int, size: int = 256) -> Path:
    """``images`` of scikit-learn's 1,797 real 8x8 digits, upscaled to ``size`` px RGB JPEGs in train/ and val/."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    order = np.random.default_rng(0).permutation(len(digits.target))[:images]
    for n, i in enumerate(order):
        split = "val" if n % 5 == 0 else "train"
        out = root / split / str(digits.target[i])
        out.mkdir(parents=True, exist_ok=True)
        pixels = (digits.images[i] * 255 / 16).astype(np.uint8)
        Image.fromarray(pixels).resize((size, size), Image.BICUBIC).convert("RGB").save(out / f"{i}.jpg", quality=90)
    return root


def recipe(augment: bool) -> dict:
    """The recipe both commands are given: augmentation off is crops and flips alone."""
    # RandAugment without magnitude noise: timm's posterize at a noisy magnitude above 9 asks Pillow (>= 11) for
    # 0 bits and ends timm's run mid-epoch (vitkit's transforms give 1 bit there: transforms.AtLeastOneBit)
    return {"aa": "rand-m9-inc1" if augment else None, "reprob": 0.25 if augment else 0.0,
            "mixup": 0.8 if augment else 0.0, "cutmix": 1.0 if augment else 0.0}


def vitkit_command(a, data: Path, out: Path, size: int, augment: bool, clock: Path) -> list[str]:
    r = recipe(augment)
    return [sys.executable, "-m", "vitkit.cli", "train", "fit", "-c", "deit_small_in1k",
            "--model.model_name", a.model, "--model.model_overrides", json.dumps({"img_size": size}),
            "--model.recipe.lr", str(a.lr), "--model.recipe.warmup_epochs", "0", "--model.recipe",
            '{"ema_decay": null}', "--model.labels.mixup", str(r["mixup"]), "--model.labels.cutmix", str(r["cutmix"]),
            "--data.root", str(data), "--data.img_size", str(size), "--data.batch_size", str(a.batch),
            "--data.num_workers", str(a.workers), "--data.auto_augment", str(r["aa"] or "null"),
            "--data.re_prob", str(r["reprob"]), "--data.color_jitter", "null", "--data.hflip", "0.5",
            "--trainer.accelerator", "gpu" if a.device == "cuda" else "cpu", "--trainer.devices", "1",
            "--trainer.strategy", "auto", "--trainer.precision", "bf16-mixed" if a.precision == "bf16" else "32-true",
            "--trainer.max_epochs", str(a.epochs),
            "--trainer.logger", "vitkit.lit.CSVLogger", "--trainer.callbacks+=benchmarks.train_run.StepClock",
            "--trainer.callbacks.path", str(clock), "--trainer.default_root_dir", str(out)]


def timm_command(a, data: Path, out: Path, size: int, augment: bool) -> list[str]:
    r = recipe(augment)
    return [sys.executable, str(a.timm_train), "--data-dir", str(data), "--train-split", "train", "--val-split", "val",
            "--model", a.model, "--num-classes", "10", "--img-size", str(size), "--input-size", "3", str(size),
            str(size), "--model-kwargs", f"img_size={size}", "-b", str(a.batch), "--epochs", str(a.epochs),
            "--opt", "adamw", "--lr", str(a.lr), "--weight-decay", "0.05", "--sched", "cosine",
            "--warmup-epochs", "0", "--min-lr", "1e-5", "--smoothing", "0.1", "--train-interpolation", "bicubic",
            "--reprob", str(r["reprob"]), "--remode", "pixel",
            "--mixup", str(r["mixup"]), "--cutmix", str(r["cutmix"]), "--color-jitter", "0",
            *(["--aa", r["aa"]] if r["aa"] else []), "--workers", str(a.workers), "--device", a.device,
            *(["--amp", "--amp-dtype", "bfloat16"] if a.precision == "bf16" else []),
            *(["--pin-mem"] if a.device == "cuda" else []),
            "--log-interval", "1", "--output", str(out), "--experiment", "run", "--seed", "0"]


def run(cmd: list[str], env: dict) -> tuple[float, float, list[tuple[float, str]], int]:
    """(start and end wall-clock times, every output line with the time it came, exit status)."""
    start = time.time()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    lines: list[tuple[float, str]] = []

    def read() -> None:
        for line in p.stdout:
            lines.append((time.time(), line.rstrip()))

    reader = threading.Thread(target=read)
    reader.start()
    status = p.wait()
    end = time.time()
    reader.join()
    return start, end, lines, status


def steady(steps: list[tuple[int, float, int]]) -> float:
    """img/s over the last epoch, its first step left out: (epoch, time, images) per step."""
    last = max(e for e, _, _ in steps)
    ep = [(t, n) for e, t, n in steps if e == last]
    return sum(n for _, n in ep[1:]) / (ep[-1][0] - ep[0][0])


def measure_vitkit(a, data: Path, work: Path, size: int, augment: bool, env: dict) -> dict:
    out, clock = work / "vitkit", work / "clock.jsonl"
    start, end, lines, status = run(vitkit_command(a, data, out, size, augment, clock), env)
    if status:
        raise RuntimeError("vitkit train fit failed:\n" + "\n".join(line for _, line in lines[-30:]))
    steps = [json.loads(line) for line in clock.read_text().splitlines()]
    rows = list(csv.DictReader(open(next(out.glob("logs/version_*/metrics.csv")))))
    top1 = [float(r["val/top1"]) for r in rows if r.get("val/top1")]
    return {"first_step_s": steps[0]["t"] - start, "wall_s": end - start, "top1": top1[-1],
            "steady_img_s": steady([(s["epoch"], s["t"], s["n"]) for s in steps])}


TIMM_STEP = re.compile(r"Train: (\d+) \[\s*(\d+)/(\d+)")


def measure_timm(a, data: Path, work: Path, size: int, augment: bool, env: dict) -> dict:
    out = work / "timm"
    start, end, lines, status = run(timm_command(a, data, out, size, augment), env)
    if status:
        raise RuntimeError("timm's train.py failed:\n" + "\n".join(line for _, line in lines[-30:]))
    steps = [(int(m[1]), t, a.batch) for t, line in lines if (m := TIMM_STEP.search(line))]
    rows = list(csv.DictReader(open(out / "run/summary.csv")))
    return {"first_step_s": steps[0][1] - start, "steady_img_s": steady(steps), "wall_s": end - start,
            "top1": float(rows[-1]["eval_top1"]) / 100}


def loader_cost(data: Path, size: int, augment: bool, batch: int) -> dict:
    """CPU-seconds per training image of each loader, no workers (so every CPU-second is this process's)."""
    import torch
    from timm.data import ImageDataset, create_transform
    from timm.data.loader import fast_collate

    from vitkit.lit import ImageFolderDataModule

    r = recipe(augment)
    dm = ImageFolderDataModule(str(data), img_size=size, batch_size=batch, num_workers=0, auto_augment=r["aa"],
                               re_prob=r["reprob"], color_jitter=None, hflip=0.5, scale=(0.08, 1.0), pin_memory=False)
    dm.setup("fit")
    tf = create_transform(input_size=(3, size, size), is_training=True, use_prefetcher=True, scale=(0.08, 1.0),
                          hflip=0.5, color_jitter=0.0, auto_augment=r["aa"], interpolation="bicubic",
                          re_prob=r["reprob"], re_mode="pixel")
    theirs = torch.utils.data.DataLoader(ImageDataset(str(data / "train"), transform=tf), batch_size=batch,
                                         shuffle=True, collate_fn=fast_collate, drop_last=True)
    out = {}
    for name, loader in (("vitkit", dm.train_dataloader()), ("timm", theirs)):
        t0, n = time.process_time(), 0
        for x, y, *_ in loader:
            assert x.dtype == torch.uint8, (name, x.dtype)
            n += len(y)
        out[name] = (time.process_time() - t0) / n
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--timm-train", type=Path, default=DEFAULT_TIMM, help="timm's train.py (not in timm's wheel)")
    p.add_argument("--root", type=Path, help="an ImageNet-style folder (default: --images digits as JPEGs)")
    p.add_argument("--images", type=int, default=1000)
    p.add_argument("--model", default="vit_tiny_patch16_224")
    p.add_argument("--sizes", type=int, nargs="+", default=[64, 224])
    p.add_argument("--augment", nargs="+", choices=["off", "on"], default=["off", "on"])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--rounds", type=int, default=1, help="interleaved pairs per setting")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="bf16: autocast in both")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/train_run.json")
    a = p.parse_args(argv)
    if not a.timm_train.is_file():
        p.error(f"--timm-train {a.timm_train}: no such file (timm's train.py, from its source repository)")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        data = a.root or write_folder(Path(tmp) / "data", a.images)
        for size in a.sizes:
            for aug in a.augment:
                on = aug == "on"
                cost = loader_cost(data, size, on, a.batch)
                for i in range(a.rounds):
                    for tool, measure in (("vitkit", measure_vitkit), ("timm", measure_timm)):
                        work = Path(tempfile.mkdtemp(dir=tmp))
                        row = {"tool": tool, "size": size, "augment": aug, "round": i,
                               **measure(a, data, work, size, on, env), "loader_cpu_s_per_img": cost[tool]}
                        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}),
                              flush=True)
                        results.append(row)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"cpu": platform.processor() or platform.machine(), "args": {
        k: str(v) for k, v in vars(a).items()}, "runs": results}, indent=1))
    return results


if __name__ == "__main__":
    main()
