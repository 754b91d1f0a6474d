"""Token merging's trade-off on a trained checkpoint: for each r, images per second, GMACs and top-1 on the
checkpoint's own validation data, without retraining (``vitkit bench --checkpoint CKPT --token-merging 0,4,8``).

The validation data is the checkpoint's: a Lightning checkpoint of ``vitkit train`` records its data module and
that module's arguments, which are rebuilt here; any other checkpoint takes ``--val-dir``, a folder of class
folders (an ImageNet-style ``val/``), read with the model's eval transform. Speed is timed interleaved (every r
once per round) on random input of the model's size, so that load drift hits all of them alike.
"""

from __future__ import annotations

import importlib
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

import vitkit
from vitkit.benchmarking.flops import count_gmacs
from vitkit.benchmarking.timing import Entry, time_rounds, warm_up
from vitkit.checkpoints.names import capabilities
from vitkit.errors import UsageError
from vitkit.models.config import pair

COLUMNS = ["model", "token_merging", "tokens_last_block", "img_per_s", "gmacs", "top1", "top1_drop", "val_images",
           "batch_size", "device"]


def validation_loader(checkpoint: str, val_dir: str | None, model: nn.Module, batch_size: int):
    """The checkpoint's validation loader: its recorded data module rebuilt, or an ImageNet-style ``val_dir``."""
    if val_dir is None:
        try:  # tensors and plain values only, as Lightning reads a checkpoint's hyperparameters
            ckpt = torch.load(checkpoint, map_location="cpu", weights_only=True)
        except Exception:  # a folder, safetensors, or a file torch cannot read safely
            ckpt = None
        hp = ckpt.get("datamodule_hyper_parameters") if isinstance(ckpt, dict) else None
        if not hp or "_class_path" not in hp:
            raise UsageError(f"{checkpoint} records no data module (only a Lightning checkpoint of `vitkit "
                             "train` does); give --val-dir, a folder of class folders (an ImageNet-style val/)")
        module, _, cls = hp["_class_path"].rpartition(".")
        kwargs = {k: v for k, v in hp.items() if not k.startswith("_")}
        dm = getattr(importlib.import_module(module), cls)(**kwargs)
        dm.hparams.batch_size = batch_size
        dm.setup("validate")
        return dm.val_dataloader()
    from torch.utils.data import DataLoader

    from vitkit.data.folder import SkippingImageFolder, collate_skipping
    from vitkit.data.transforms import eval_transform

    return DataLoader(SkippingImageFolder(val_dir, eval_transform(model.cfg)), batch_size=batch_size,
                      collate_fn=collate_skipping)


@torch.no_grad()
def top1(model: nn.Module, loader) -> tuple[float, int]:
    """Top-1 accuracy and the number of images."""
    right = seen = 0
    for batch in loader:  # (x, y), or (x, y, skipped) from a folder's loader
        x, y = batch[0], batch[1]
        if x is None:  # every image of the batch unreadable
            continue
        right += int((model(x).argmax(-1) == y).sum())
        seen += len(y)
    return right / seen, seen


class _Merging(nn.Module):
    """The checkpoint's model with r token pairs merged per block: one model, shared by the entry of every r."""

    def __init__(self, model: nn.Module, r: int) -> None:
        super().__init__()
        self.model, self.r = model, r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.model.set_token_merging(self.r)
        return self.model(x)


def images_per_second(model: nn.Module, args, shape: tuple[int, ...]) -> dict[int, float]:
    """Median img/s of each r, timed by the bench's own warm-up and interleaved rounds."""
    device, batch = torch.device(args.device), args.batch_sizes[0]
    entries = [Entry("vitkit", model.name, "infer", batch, lambda r=r: _Merging(model, r), shape, token_merging=r)
               for r in args.token_merging]
    for e in entries:
        warm_up(e, args, device)
    time_rounds(entries, args, device)
    return {e.token_merging: e.batch_size / statistics.median(e.times) for e in entries}


def curve(args) -> list[dict]:
    """One row per r: speed, GMACs and top-1 of the checkpoint's model with r token pairs merged per block."""
    model = vitkit.create_model(checkpoint=args.checkpoint).eval()
    if not capabilities(model.name).token_merging:
        raise UsageError(f"token merging is for ViT/DeiT models; {args.checkpoint} holds {model.name}")
    loader = validation_loader(args.checkpoint, args.val_dir, model, args.batch_sizes[0])
    shape = (model.cfg.in_chans, *pair(model.cfg.img_size))
    rows = []
    for r in args.token_merging:
        model.set_token_merging(r)
        acc, n = top1(model, loader)
        tokens = model.forward_features(torch.zeros(1, *shape)).shape[1]
        rows.append(dict(model=model.name, token_merging=r, tokens_last_block=tokens, top1=round(acc, 4),
                         gmacs=round(count_gmacs(model), 4), val_images=n, batch_size=args.batch_sizes[0]))
        print(f"r={r}: top-1 {acc:.4f} on {n} images, {tokens} tokens after the last block", file=sys.stderr)
    speed = images_per_second(model, args, shape)
    base = rows[0]["top1"]
    for row in rows:
        row.update(img_per_s=round(speed[row["token_merging"]], 2), top1_drop=round(base - row["top1"], 4),
                   device=f"cpu x{torch.get_num_threads()} threads")
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS[1:7]) + " |", "|" + "---|" * 6]
    lines += ["| " + " | ".join(str(r[c]) for c in COLUMNS[1:7]) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Top-1 against img/s, each point labelled with its r."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    xs, ys = [r["img_per_s"] for r in rows], [100 * r["top1"] for r in rows]
    ax.plot(xs, ys, marker="o")
    for row, x, y in zip(rows, xs, ys, strict=True):
        ax.annotate(f"r={row['token_merging']}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_ylim(max(0.0, min(ys) - 5.0), min(100.0, max(ys) + 1.0))  # a drop of tenths of a point looks like one
    ax.set_xlabel("images / s (median)")
    ax.set_ylabel("top-1 (%)")
    ax.set_title(title, fontsize=8, wrap=True)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
