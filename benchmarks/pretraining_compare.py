"""MAE, SimMIM and DINO on the same unlabeled data, scored the same way: each recipe pre-trains the demo's ViT on
the digits that ship with scikit-learn (their labels unread), then its frozen features are scored on the 180
held-out digits by a weighted k-NN (k=20, the 1,437 training digits voting) and by a linear probe (logistic
regression) trained on all 1,437 labels and on 10 per class; random weights are the floor.

    python benchmarks/pretraining_compare.py --epochs 30 --seeds 0 --out benchmarks/results/pretraining_digits.md
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.preprocessing import StandardScaler

import vitkit
from vitkit.benchmarking.bench import device_name
from vitkit.cli.train import cli_main
from vitkit.evaluation.metrics import knn_top1
from vitkit.lit import DigitsDataModule

# recipe, extra arguments, the pooling the method's features are read with (MAE and SimMIM average their patch
# tokens, as they fine-tune; DINO's class token is what its heads train)
QUIET = ["--model.num_pictures", "0"]  # no reconstruction pictures
METHODS = {"MAE": ("mae_vit_tiny_digits", QUIET, "avg"),
           # SimMIM's own masking (0.6, in blocks of 2 x 2 patches here) and its one-layer decoder: MAE's unset
           "SimMIM": ("mae_vit_tiny_digits", [*QUIET, "--model.objective", "simmim", "--model.mask_ratio", "0.6",
                                              "--model.mask_patch_size", "8", *(f"--model.{k}=null" for k in (
                                                  "norm_pix_loss", "decoder_embed_dim", "decoder_depth",
                                                  "decoder_num_heads", "decoder_mlp_ratio"))], "avg"),
           "DINO": ("dino_vit_tiny_digits", [], "token")}
TINY = dict(img_size=32, patch_size=4, embed_dim=96, num_heads=3, depth=2, num_classes=0)  # the recipes' ViT


def features(net, pool: str):
    dm = DigitsDataModule(img_size=32, val_fraction=0.1, seed=0, augment=False)
    dm.setup("fit")
    net.reset_classifier(0, global_pool=pool)
    net.eval()
    with torch.no_grad():
        return [(net.forward_head(net.forward_features(ds.tensors[0]), pre_logits=True), ds.tensors[1])
                for ds in (dm.train_set, dm.val_set)]


def scores(net, pool: str, seed: int) -> dict[str, float]:
    (a, ay), (b, by) = features(net, pool)
    out = {"k-NN": knn_top1(a, ay, b, by, k=20)}
    rng = np.random.default_rng(seed)
    few = np.concatenate([rng.choice(np.flatnonzero(ay.numpy() == c), 10, replace=False) for c in range(10)])
    for name, rows in (("probe, all labels", np.arange(len(ay))), ("probe, 10 per class", few)):
        scaler = StandardScaler().fit(a[rows].numpy())
        probe = LogisticRegression(max_iter=2000).fit(scaler.transform(a[rows].numpy()), ay[rows].numpy())
        out[name] = float(probe.score(scaler.transform(b.numpy()), by.numpy()))
    return out


def pretrain(recipe: str, extra: list[str], epochs: int, seed: int, root: Path):
    cli = cli_main(["fit", "-c", recipe, "--trainer.accelerator", "cpu", "--trainer.devices", "1",
                    "--trainer.max_epochs", str(epochs), "--trainer.default_root_dir", str(root),
                    "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
                    "--seed_everything", str(seed), *extra])
    return vitkit.create_model(checkpoint=root / "checkpoints/last.ckpt"), cli


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--seeds", default="0")
    p.add_argument("--methods", default=",".join(METHODS), help="of " + ", ".join(METHODS))
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows: dict[str, list[dict[str, float]]] = {}
    minutes: dict[str, list[float]] = {}
    for seed in (int(s) for s in args.seeds.split(",")):
        torch.manual_seed(seed)
        rows.setdefault("random weights", []).append(scores(vitkit.create_model("vit_tiny_patch16_224", **TINY),
                                                            "token", seed))
        for name in args.methods.split(","):
            recipe, extra, pool = METHODS[name]
            start = time.perf_counter()
            net, _ = pretrain(recipe, extra, args.epochs, seed, Path(tempfile.mkdtemp()) / name)
            minutes.setdefault(name, []).append((time.perf_counter() - start) / 60)
            rows.setdefault(name, []).append(scores(net, pool, seed))
            print(name, seed, rows[name][-1], flush=True)
    metrics = list(next(iter(rows.values()))[0])

    def cell(values: list[float], digits: int = 3) -> str:
        lo, hi = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
        return lo if lo == hi else f"{lo}-{hi}"

    lines = [f"# MAE, SimMIM and DINO on the digits: {args.epochs} epochs, seeds {args.seeds}", "",
             f"The demo's ViT (2 blocks, width 96, 32 px), pre-trained on the 1,437 training digits without labels, "
             f"scored on the 180 held-out ones; {device_name(torch.device('cpu'))}, torch {torch.__version__}", "",
             "| method | pooling | " + " | ".join(metrics) + " | pre-training (min) |",
             "|---|---|" + "---|" * (len(metrics) + 1)]
    for name, results in rows.items():
        pool = METHODS[name][2] if name in METHODS else "token"
        time_cell = cell(minutes[name], 1) if name in minutes else "—"
        lines.append(f"| {name} | {pool} | " + " | ".join(cell([r[m] for r in results]) for m in metrics)
                     + f" | {time_cell} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
