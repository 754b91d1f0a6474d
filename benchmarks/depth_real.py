"""Depth learned from a real backbone on real images: DPT's head on the real DINOv2 ViT-S/14 of ``../shared/real``
(``depth_finetune_small_data``: the head on the frozen features first, then the whole model) on perspective scenes
of real MNIST digits, against a baseline on the same frozen features, both scored by the same Eigen errors on the
same held-out scenes, and on scikit-image's real Middlebury stereo pair (its disparity as inverse depth).

Scenes: a ground plane whose inverse depth is linear in the rows (2 m at the bottom, 10 m at the top), striped
every half metre of its distance, and 1 to 4 digits standing at random depths, each the size its depth gives it
(nearer is larger), nearer digits covering farther ones. Relative depth: each prediction is aligned to the truth
by least squares in inverse depth before it is scored (``vitkit.evaluation.depth``).
Baseline: a ridge regression (scikit-learn's RidgeCV) per patch from the frozen backbone's last-layer tokens to the
patch's mean inverse depth, scored the same way at the patch grid.

    python ../shared/real/prepare.py        # once: ~/.cache/vitkit-real/{dino_s14.safetensors,mnist_5k.npz}
    python benchmarks/depth_real.py --out benchmarks/results/depth_real.md
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

REAL = Path.home() / ".cache" / "vitkit-real"
NEAR, FAR = 2.0, 10.0


def scenes(digits: np.ndarray, n: int, size: int, rng: np.random.Generator) -> list[tuple[np.ndarray, np.ndarray]]:
    """``n`` (image uint8 (size, size, 3), depth float32 (size, size) in metres)."""
    rows = np.arange(size, dtype=np.float32)[:, None]
    ground = 1 / (1 / NEAR + (1 / FAR - 1 / NEAR) * (size - 1 - rows) / (size - 1))  # inverse depth linear in rows
    out = []
    for _ in range(n):
        depth = np.repeat(ground, size, axis=1).astype(np.float32)
        image = 60 + 40 * (np.floor(depth * 2) % 2)
        for d in sorted(rng.uniform(NEAR + 0.5, FAR - 2, size=int(rng.integers(1, 5))), reverse=True):  # far first
            s = int(np.clip(round(size * 0.9 * NEAR / d), 8, size - 2))
            digit = np.asarray(Image.fromarray(digits[int(rng.integers(len(digits)))]).resize((s, s), Image.BILINEAR))
            x, y = int(rng.integers(0, size - s)), int(rng.integers(0, size - s))
            ink = digit > 60
            image[y:y + s, x:x + s][ink] = 200 + digit[ink] / 255 * 55
            depth[y:y + s, x:x + s][ink] = d
        out.append((np.repeat(image.clip(0, 255).astype(np.uint8)[..., None], 3, axis=2), depth))
    return out


def write_split(root: Path, split: str, items) -> None:
    (root / "images" / split).mkdir(parents=True, exist_ok=True)
    (root / "depth" / split).mkdir(parents=True, exist_ok=True)
    for i, (image, depth) in enumerate(items):
        Image.fromarray(image).save(root / "images" / split / f"{i:04d}.png")
        np.save(root / "depth" / split / f"{i:04d}.npy", depth)


def motorcycle() -> tuple[np.ndarray, np.ndarray]:
    """scikit-image's Middlebury pair: the left image and 1 / its disparity (0 where the disparity is unknown)."""
    from skimage import data

    left, _, disparity = data.stereo_motorcycle()
    depth = np.where(np.isfinite(disparity) & (disparity > 0), 1 / np.where(disparity > 0, disparity, 1), 0)
    return left, depth.astype(np.float32)


def baseline(train, tests: dict[str, list], dino: Path, size: int) -> dict[str, dict[str, float]]:
    """The per-patch ridge regression (module docstring), scored by Eigen's errors on each of ``tests``."""
    import torch.nn.functional as F
    from sklearn.linear_model import RidgeCV

    import vitkit
    from vitkit.evaluation.depth import DepthMetrics, scored

    backbone = vitkit.create_model("vit_small_patch14_dinov2", img_size=size, num_classes=0,
                                   checkpoint=str(dino)).eval()
    mean, std = torch.tensor(backbone.cfg.mean).view(1, 3, 1, 1), torch.tensor(backbone.cfg.std).view(1, 3, 1, 1)

    def tokens(items) -> torch.Tensor:
        x = torch.stack([torch.from_numpy(np.asarray(Image.fromarray(im).resize((size, size), Image.BICUBIC)))
                         .permute(2, 0, 1).float() / 255 for im, _ in items])
        with torch.inference_mode():
            return torch.cat([backbone.forward_intermediates((x[i:i + 16] - mean) / std, indices=[11], norm=True,
                                                             intermediates_only=True)[0]
                              for i in range(0, len(x), 16)])  # (N, C, h, w)

    grid = size // backbone.patch_size
    features = tokens(train)
    inverse = torch.stack([torch.from_numpy(d) for _, d in train])[:, None].reciprocal()
    target = F.adaptive_avg_pool2d(inverse, grid)[:, 0]  # each patch's mean inverse depth
    ridge = RidgeCV(alphas=np.logspace(-2, 3, 11)).fit(features.permute(0, 2, 3, 1).reshape(-1, features.shape[1]),
                                                       target.reshape(-1))
    out = {}
    for name, items in tests.items():
        f = tokens(items)
        pred = torch.from_numpy(ridge.predict(f.permute(0, 2, 3, 1).reshape(-1, f.shape[1])).astype(np.float32))
        metric = DepthMetrics()
        for p, (_, d) in zip(pred.view(len(items), grid, grid), items, strict=True):
            aligned, valid = scored(p, torch.from_numpy(d), "relative", None)
            metric.update(aligned[None], torch.from_numpy(d)[None], valid[None])
        out[name] = metric.compute()
    return out


def fine_tune(root: Path, dino: Path, size: int, epochs: int, batch: int, run: Path, recipe: str,
              splits: list[str]) -> dict[str, dict[str, float]]:
    """The ``recipe`` from the real backbone, scored by ``vitkit evaluate`` on each of ``splits``."""
    from vitkit.cli import main as vitkit_main

    status = vitkit_main(["train", "fit", "-c", recipe, "--model.checkpoint", str(dino), "--data.root", str(root),
                          "--data.img_size", str(size), "--data.batch_size", str(batch), "--data.num_workers", "2",
                          "--trainer.max_epochs", str(epochs), "--trainer.accelerator", "cpu",
                          "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(run)])
    if status != 0:
        raise SystemExit(f"training failed ({status})")
    best = sorted((run / "checkpoints").glob("best-*.ckpt"))[-1]
    out = {}
    for split in splits:
        status = vitkit_main(["evaluate", "--checkpoint", str(best), "--data.root", str(root), "--split", split,
                              "-o", str(run / f"eval_{split}")])
        if status != 0:
            raise SystemExit(f"evaluate failed ({status})")
        out[split] = json.loads((run / f"eval_{split}" / "metrics.json").read_text())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train", type=int, default=200)
    ap.add_argument("--val", type=int, default=50)
    ap.add_argument("--size", type=int, default=112, help="the scenes' side and the model's, a multiple of 14")
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--recipe", default="depth_finetune_small_data")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    dino, mnist = REAL / "dino_s14.safetensors", REAL / "mnist_5k.npz"
    if not dino.exists() or not mnist.exists():
        raise SystemExit(f"{REAL} lacks the real files: run ../shared/real/prepare.py first")
    digits = np.load(mnist)["x"]
    rng = np.random.default_rng(args.seed)
    order = rng.permutation(len(digits))
    train = scenes(digits[order[:4000]], args.train, args.size, rng)
    val = scenes(digits[order[4000:]], args.val, args.size, rng)  # digits never trained on
    photo = [motorcycle()]
    from vitkit.benchmarking.bench import cpu_name

    cpu = cpu_name()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "scenes"
        write_split(root, "train", train)
        write_split(root, "val", val)
        write_split(root, "test", photo)  # the Middlebury photo is the folder's test split
        start = time.perf_counter()
        base = baseline(train, {"val": val, "motorcycle": photo}, dino, args.size)
        base_time = time.perf_counter() - start
        start = time.perf_counter()
        tuned = fine_tune(root, dino, args.size, args.epochs, args.batch, Path(tmp) / "run", args.recipe,
                          ["val", "test"])
        tuned_time = time.perf_counter() - start

    def cells(r: dict) -> str:
        return f"{r['AbsRel']:.4f} | {r['RMSE']:.3f} | {r['delta1']:.3f}"

    rows = [f"CPU: {cpu}, {torch.get_num_threads()} threads; torch {torch.__version__}; {args.train} training and "
            f"{args.val} held-out perspective scenes of real MNIST digits at {args.size} px (seed {args.seed}); the "
            "real DINOv2 ViT-S/14; relative depth, aligned by least squares in inverse depth", "",
            "| model | scenes: AbsRel | RMSE (m) | delta1 | Middlebury motorcycle: AbsRel | RMSE (1/disparity) "
            "| delta1 | wall time |", "|---|---|---|---|---|---|---|---|",
            f"| per-patch ridge regression on the frozen tokens | {cells(base['val'])} | {cells(base['motorcycle'])} | "
            f"{base_time:.0f} s |",
            f"| DPT head (`{args.recipe}`), {args.epochs} epochs | {cells(tuned['val'])} | "
            f"{cells(tuned['test'])} | {tuned_time:.0f} s |"]
    from vitkit.benchmarking.bench import publish

    publish("\n".join(rows), args.out)


if __name__ == "__main__":
    main()
