"""Images/s per loader worker with the training transforms at 224: an ImageNet-style folder read with PIL, the
same images as litdata shards (``vitkit prepare-data``), each with PIL and with torchvision's libjpeg-turbo
decoder (``decode_jpeg``), and how far the two decoders' pixels are apart.

    python benchmarks/dataloader.py --images 1024 --workers 1,2 --out benchmarks/results/dataloader.csv

Without ``--root`` it writes ImageNet-like JPEGs (about 500x375, quality 90, 10 classes) cut from the two
photos that ship with scikit-learn, on local disk. Every loader reads the whole train split once to warm the
page cache, then the figure is the median of ``--rounds`` timed passes, the loaders taking turns; img/s counts
from the first batch on (the time to the first batch, worker start-up, is its own column), and the mean number of
classes in a full batch shows that the loader mixes the classes (10 classes: about 10 in a batch of 64). The
transforms are those of ``ImageFolderDataModule``/``StreamingImageDataModule`` (RandomResizedCrop, flip,
RandAugment m9, random erasing). Writes the CSV, the same rows as JSON and a markdown table.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from vitkit.benchmarking.bench import write_rows

COLUMNS = ["loader", "decoder", "workers", "img_per_s", "img_per_s_per_worker", "vs_imagefolder_pil", "first_batch_s",
           "classes_per_batch", "images",
           "batch_size", "img_size", "cpu", "torch"]


def write_photos(root: Path, n: int, classes: int = 10, seed: int = 0) -> None:
    """``n`` JPEGs in ``root/{train,val}/<class>/``: random crops of scikit-learn's sample photos, resized to
    ImageNet's typical 500x375 (or 375x500), flipped at random, quality 90."""
    from sklearn.datasets import load_sample_images

    photos = [Image.fromarray(a) for a in load_sample_images().images]  # 640x427 each
    rng = np.random.default_rng(seed)
    for split, count in (("train", n), ("val", max(classes, n // 10))):
        for i in range(count):
            img = photos[i % len(photos)]
            w, h = int(rng.integers(320, 640)), int(rng.integers(240, 427))
            x, y = int(rng.integers(0, 640 - w + 1)), int(rng.integers(0, 427 - h + 1))
            size = (500, 375) if w >= h else (375, 500)
            out = img.crop((x, y, x + w, y + h)).resize(size, Image.BICUBIC)
            if rng.random() < 0.5:
                out = out.transpose(Image.FLIP_LEFT_RIGHT)
            d = root / split / f"class_{i % classes:02d}"
            d.mkdir(parents=True, exist_ok=True)
            out.save(d / f"{i:06d}.jpg", quality=90)


def decoder_agreement(files: list[Path]) -> dict[str, float]:
    """Pixel differences between PIL and torchvision decoding the same JPEGs, raw and after the eval transform."""
    from types import SimpleNamespace

    from vitkit.data.folder import decode
    from vitkit.data.transforms import eval_transform

    cfg = SimpleNamespace(img_size=224, in_chans=3, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225),
                          crop_pct=0.875, interpolation="bicubic")
    tf = eval_transform(cfg)
    raw, after = [], []
    for f in files:
        data = f.read_bytes()
        a, b = decode(data, "pil"), decode(data, "torchvision")
        diff = np.abs(np.asarray(a, dtype=np.int16) - np.asarray(b, dtype=np.int16))
        raw.append((diff.max(), diff.mean()))
        after.append((tf(a) - tf(b)).abs().mul(torch.tensor(cfg.std).view(3, 1, 1)).mul(255).max().item())
    return {"raw_max_levels": float(max(m for m, _ in raw)), "raw_mean_levels": float(np.mean([m for _, m in raw])),
            "eval_max_levels": float(max(after))}


def loaders(root: Path, shards: Path, workers: int, batch_size: int, img_size: int) -> dict:
    from vitkit.lit import ImageFolderDataModule, StreamingImageDataModule

    out = {}
    for name, cls, data_root in (("imagefolder", ImageFolderDataModule, root),
                                 ("streaming", StreamingImageDataModule, shards)):
        for decoder in ("pil", "torchvision"):
            dm = cls(str(data_root), img_size=img_size, batch_size=batch_size, num_workers=workers, decoder=decoder,
                     pin_memory=False)
            dm.setup("fit")
            out[name, decoder] = dm
    return out


def one_pass(dm) -> tuple[int, float, float, float]:
    """(images after the first batch, seconds they took, seconds to the first batch: worker start-up, mean number
    of classes in a full batch)."""
    loader = dm.train_dataloader()
    t0, n, t1, classes = time.perf_counter(), 0, None, []
    for _, y, _ in loader:
        if y is not None and len(y) == dm.hparams.batch_size:
            classes.append(len(set(y.tolist())))
        if t1 is None:
            t1 = time.perf_counter()
        else:
            n += 0 if y is None else len(y)
    return n, time.perf_counter() - t1, t1 - t0, statistics.mean(classes)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", help="an ImageNet-layout folder (default: write --images JPEGs to a temporary one)")
    p.add_argument("--images", type=int, default=1024)
    p.add_argument("--workers", default="1,2", help="comma-separated loader worker counts")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/dataloader.csv")
    a = p.parse_args(argv)
    from vitkit.data.shards import prepare_data

    torch.set_num_threads(1)  # as in a loader worker: one decode per core
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(a.root) if a.root else Path(tmp) / "images"
        if not a.root:
            write_photos(root, a.images)
        shards = Path(tmp) / "shards"
        prepare_data(root, shards, workers=2)
        files = sorted((root / "train").rglob("*.jpg"))
        agree = decoder_agreement(files[:64])
        rows = []
        for workers in [int(w) for w in a.workers.split(",")]:
            dms = loaders(root, shards, workers, a.batch_size, a.img_size)
            for dm in dms.values():
                one_pass(dm)  # warm: page cache, worker start-up code paths
            times: dict = {k: [] for k in dms}
            starts: dict = {k: [] for k in dms}
            counts: dict = {}
            mixed: dict = {k: [] for k in dms}
            for _ in range(a.rounds):
                for k, dm in dms.items():
                    counts[k], dt, start, classes = one_pass(dm)
                    times[k].append(dt)
                    starts[k].append(start)
                    mixed[k].append(classes)
            base = counts["imagefolder", "pil"] / statistics.median(times["imagefolder", "pil"])
            for (loader, decoder), ts in times.items():
                ips = counts[loader, decoder] / statistics.median(ts)
                rows.append({"loader": loader, "decoder": decoder, "workers": workers, "img_per_s": round(ips, 1),
                             "img_per_s_per_worker": round(ips / max(workers, 1), 1),
                             "vs_imagefolder_pil": round(ips / base, 2),
                             "first_batch_s": round(statistics.median(starts[loader, decoder]), 2),
                             "classes_per_batch": round(statistics.mean(mixed[loader, decoder]), 2),
                             "images": counts[loader, decoder],
                             "batch_size": a.batch_size, "img_size": a.img_size, "cpu": platform.processor() or
                             platform.machine(), "torch": torch.__version__})
                print(" ".join(f"{c}={rows[-1][c]}" for c in COLUMNS[:8]), flush=True)
    out = Path(a.out)
    write_rows(rows, out, COLUMNS)
    lines = ["| loader | decoder | workers | img/s | img/s per worker | vs ImageFolder (PIL) | first batch (s) | "
             "classes per batch |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['loader']} | {r['decoder']} | {r['workers']} | {r['img_per_s']} | {r['img_per_s_per_worker']} | "
              f"{r['vs_imagefolder_pil']:.2f}x | {r['first_batch_s']} | {r['classes_per_batch']} |" for r in rows]
    lines.append(f"\nPIL vs torchvision decoding of the same {min(64, len(files))} JPEGs: at most "
                 f"{agree['raw_max_levels']:.0f} levels apart (mean {agree['raw_mean_levels']:.3f}); after the eval "
                 f"transform at most {agree['eval_max_levels']:.1f} levels.")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"decoders: {agree}")
    return rows


if __name__ == "__main__":
    main()
