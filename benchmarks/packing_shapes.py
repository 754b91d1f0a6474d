"""What packing's training transform gains on images far from square: DINOv2 ViT-S/14 fine-tuned with
``finetune_small_data`` on images of their own shapes, packed (each image whole, at a random share of the patch
budget), beside the same recipe squashed (``--data.crop_mode squash``), centre-cropped (the default) and packed with
timm's NaFlex random crop (a crop of scale ``--data.scale`` and aspect ratio 3:4 to 4:3, which packing used before).

Two data sets, as ImageNet-layout folders:

- ``strips``: three real MNIST digits side by side (28 x 84), labelled by the LEFT one; 300 training and 300
  validation strips, the validation digits from other scans; 84 px, 3 epochs. What names the label is at one end.
- ``photos``: crops of scikit-image's 14 photographs at aspect ratios 1:3 to 3:1 (``packing.photographs``), 20 and
  20 per photograph; 112 px, 3 epochs. Any part of the image names it.

Needs ``../shared/real/prepare.py``'s files (``~/.cache/vitkit-real``: the DINOv2 weights and the MNIST digits):

    python benchmarks/packing_shapes.py strips --seeds 0 1 2 3 --out benchmarks/results/packing_shapes_strips.md
    python benchmarks/packing_shapes.py photos --seeds 0 1 --out benchmarks/results/packing_shapes_photos.md
"""

from __future__ import annotations

import argparse
import csv
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from packing import PHOTOS, photographs  # benchmarks/packing.py, beside this script
from PIL import Image

import vitkit.data.packing as packing
from vitkit.benchmarking.bench import device_name, publish
from vitkit.cli.train import cli_main

REAL = Path("~/.cache/vitkit-real").expanduser()
MODES = {"packed, whole": ["--data.packing", "true"], "squashed": ["--data.crop_mode", "squash"],
         "centre crop": [], "packed, timm's random crop": ["--data.packing", "true"]}
SETS = {"strips": (84, 3), "photos": (112, 3)}  # image size, epochs


def write_strips(root: Path, train: int = 300, val: int = 300, seed: int = 0) -> None:
    """Strips of three different scans side by side, each in the folder of its left digit."""
    data = np.load(REAL / "mnist_5k.npz")
    x, y = data["x"], data["y"]
    rng = np.random.default_rng(seed)
    order = np.random.default_rng(123).permutation(len(y))  # the file is sorted by digit
    pools = {"train": order[:2500], "val": order[2500:]}
    for split, count in (("train", train), ("val", val)):
        for i in range(count):
            picked = rng.choice(pools[split], 3, replace=False)
            folder = root / split / str(int(y[picked[0]]))
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(np.concatenate([x[j] for j in picked], axis=1)).convert("RGB").save(folder / f"{i}.png")


def write_photos(root: Path, train: int = 20, val: int = 20) -> None:
    """``train`` and ``val`` crops per photograph, at most 160 px a side, a crop of each photograph in turn."""
    crops = photographs(len(PHOTOS) * (train + val), seed=1)
    for i, crop in enumerate(crops):
        k = i // len(PHOTOS)
        folder = root / ("train" if k < train else "val") / PHOTOS[i % len(PHOTOS)]
        folder.mkdir(parents=True, exist_ok=True)
        scale = 160 / max(crop.shape[-2:])
        h, w = max(8, int(crop.shape[-2] * scale)), max(8, int(crop.shape[-1] * scale))
        img = torch.nn.functional.interpolate(crop[None], size=(h, w), mode="bilinear", antialias=True)[0]
        Image.fromarray((img.clamp(0, 1) * 255).byte().permute(1, 2, 0).numpy()).save(folder / f"{k}.png")


class _TimmCrop:
    """Packing's train transform with timm's NaFlex random crop in place of the whole image, while in use."""

    def __enter__(self):
        from timm.data.naflex_transforms import RandomResizedCropToSequence

        self.original = original = packing.Packing.train_transform

        def train_transform(self, cfg, *, scale, **kwargs):
            tf = original(self, cfg, scale=scale, **kwargs)
            tf.transforms[0] = RandomResizedCropToSequence(self.patch_size, self.max_patches, scale=tuple(scale),
                                                           ratio=(3 / 4, 4 / 3), interpolation="bicubic")
            return tf

        packing.Packing.train_transform = train_transform

    def __exit__(self, *exc):
        packing.Packing.train_transform = self.original


def run(data: Path, out: Path, mode: str, seed: int, size: int, epochs: int) -> tuple[float, float]:
    """(the last epoch's val/top1, seconds) of one run."""
    start = time.perf_counter()
    args = ["fit", "-c", "finetune_small_data", "--model.checkpoint", str(REAL / "dino_s14.safetensors"),
            "--model.model_name", "vit_small_patch14_dinov2", "--data.root", str(data), "--data.img_size", str(size),
            "--trainer.max_epochs", str(epochs), "--trainer.precision", "32-true", "--trainer.enable_progress_bar",
            "false", "--seed_everything", str(seed), "--trainer.default_root_dir", str(out), "--data.num_workers",
            "0", *MODES[mode]]
    if mode == "packed, timm's random crop":
        with _TimmCrop():
            cli_main(args)
    else:
        cli_main(args)
    rows = list(csv.DictReader(open(next(out.rglob("metrics.csv")))))
    return float([r["val/top1"] for r in rows if r.get("val/top1")][-1]), time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data", choices=sorted(SETS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    size, epochs = SETS[a.data]
    results: dict[str, list[float]] = {m: [] for m in a.modes}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / a.data
        (write_strips if a.data == "strips" else write_photos)(data)
        for seed in a.seeds:  # interleaved: each seed runs every mode
            for mode in a.modes:
                results[mode].append(run(data, Path(tmp) / f"{mode}-{seed}".replace(" ", "_"), mode, seed, size,
                                         epochs)[0])
    lines = [f"{a.data}: finetune_small_data from DINOv2 ViT-S/14, {size} px, {epochs} epochs, fp32; "
             f"{device_name(torch.device('cpu'))}; seeds {', '.join(map(str, a.seeds))}", "",
             "| training images | val top-1, each seed |", "|---|---|"]
    lines += [f"| {mode} | {', '.join(f'{x:.3f}' for x in accs)} |" for mode, accs in results.items()]
    publish("\n".join(lines), a.out)


if __name__ == "__main__":
    main()
