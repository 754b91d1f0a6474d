"""Accuracy of training on images of their own shapes, packed (``--data.packing true``), beside the same recipe on
square crops (timm's resize and centre crop) and on squashed squares (``--data.crop_mode squash``), over seeds.

The task: which of scikit-image's 14 bundled photographs a crop comes from, on crops of aspect ratios from 1:3 to
3:1 (``packing.photographs``), written as an ImageNet-layout folder; the digits recipe's small ViT from scratch, at a
budget of 64 patches of 4 px (32 x 32 square), through ``vitkit train fit``.

    python benchmarks/packing_accuracy.py --seeds 0 1 2 --out benchmarks/results/packing_accuracy_cpu.md
"""

from __future__ import annotations

import argparse
import csv
import statistics
import tempfile
import time
from pathlib import Path

import torch
from packing import PHOTOS, photographs  # benchmarks/packing.py, beside this script
from PIL import Image

from vitkit.benchmarking.bench import device_name, publish
from vitkit.cli.train import cli_main

ROOT = Path(__file__).resolve().parents[1]
MODES = {"packed": ["--data.packing", "true", "--data.max_tokens", "195"],  # 3 budgets of 64 patches and a prefix
         "square crop": [], "squashed square": ["--data.crop_mode", "squash"]}


def write_folder(root: Path, train: int, val: int) -> None:
    """``train`` and ``val`` crops per photograph, as PNG files in class folders (a crop of each photograph in
    turn, so every class gets every aspect ratio)."""
    crops = photographs(len(PHOTOS) * (train + val), seed=1)
    for i, crop in enumerate(crops):
        k = i // len(PHOTOS)
        folder = root / ("train" if k < train else "val") / PHOTOS[i % len(PHOTOS)]
        folder.mkdir(parents=True, exist_ok=True)
        scale = 160 / max(crop.shape[-2:])  # at most 160 px a side, as photos come
        h, w = max(8, int(crop.shape[-2] * scale)), max(8, int(crop.shape[-1] * scale))
        img = torch.nn.functional.interpolate(crop[None], size=(h, w), mode="bilinear", antialias=True)[0]
        Image.fromarray((img.clamp(0, 1) * 255).byte().permute(1, 2, 0).numpy()).save(folder / f"{k}.png")


def run(data: Path, out: Path, seed: int, mode: str, epochs: int) -> tuple[float, float]:
    """(the last epoch's val/top1, seconds) of one run."""
    start = time.perf_counter()
    cli_main(["fit", "-c", str(ROOT / "configs/vit_tiny_digits.yaml"), "--seed_everything", str(seed),
              "--data", "vitkit.lit.ImageFolderDataModule", "--data.root", str(data), "--data.num_workers", "0",
              "--data.batch_size", "32", "--trainer.max_epochs", str(epochs), "--trainer.default_root_dir", str(out),
              "--trainer.enable_progress_bar", "false", *MODES[mode]])
    rows = list(csv.DictReader(open(next(out.rglob("metrics.csv")))))
    return float([r["val/top1"] for r in rows if r.get("val/top1")][-1]), time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--train", type=int, default=30, help="training crops per photograph")
    p.add_argument("--val", type=int, default=20, help="validation crops per photograph")
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    results: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "photos"
        write_folder(data, a.train, a.val)
        for seed in a.seeds:  # interleaved: each seed runs every mode
            for mode in MODES:
                results[mode].append(run(data, Path(tmp) / f"{mode}-{seed}".replace(" ", "_"), seed, mode, a.epochs))
    lines = [f"{len(PHOTOS)} classes (scikit-image's photographs), {a.train} training and {a.val} validation crops "
             f"each, aspect ratios 1:3 to 3:1; the digits recipe's ViT from scratch for {a.epochs} epochs, 32 px "
             f"at 4-px patches (64 patches a budget); {device_name(torch.device('cpu'))}; seeds "
             f"{', '.join(map(str, a.seeds))}", "",
             "| images | val top-1, each seed | mean | seconds a run (mean) |", "|---|---|---|---|"]
    for mode, runs in results.items():
        accs = [acc for acc, _ in runs]
        lines.append(f"| {mode} | {', '.join(f'{x:.3f}' for x in accs)} | {statistics.mean(accs):.3f} | "
                     f"{statistics.mean(s for _, s in runs):.0f} |")
    publish("\n".join(lines), a.out)


if __name__ == "__main__":
    main()
