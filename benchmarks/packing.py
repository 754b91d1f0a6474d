"""Images of their own shapes through timm's NaFlexViT-B/16 at one patch budget, images/s in inference or training
(``--train``): vitkit's packed sequences (``vitkit.models.packing``; attention within each image by a block-diagonal
mask) at a few sequence lengths, each loader batch packed on its own, against timm's NaFlexViT on its padded batches
(each image resized by timm's own rule to the same budget, padded to it), vitkit on those same padded batches, and
square resizing to the same number of patches; with ``--onnx``, vitkit's ``--packed`` export and its per-image
export in onnxruntime. One set of random weights (timm's, loaded into vitkit); the entries run in interleaved rounds
in one process, so load and clock drift hit all of them.

The images are scikit-image's bundled photographs, cropped to aspect ratios from 1:3 to 3:1.

    python benchmarks/packing.py --images 48 --budget 256 --rounds 3 --flex --out benchmarks/results/packing_cpu.md
    python benchmarks/packing.py --images 48 --budget 256 --rounds 3 --onnx --max-tokens 256,1024 \\
        --out benchmarks/results/packing_onnx_cpu.md
    python benchmarks/packing.py --images 24 --budget 256 --rounds 3 --train \\
        --out benchmarks/results/packing_train_cpu.md
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import vitkit
from vitkit.benchmarking.bench import device_name, publish
from vitkit.checkpoints.formats import to_vitkit
from vitkit.models.packing import budget_size, from_naflex, pack

PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "camera", "coins", "moon", "page", "brick", "grass", "gravel",
          "hubble_deep_field", "immunohistochemistry", "text")
RATIOS = (1 / 3, 1 / 2, 2 / 3, 1.0, 3 / 2, 2.0, 3.0)  # height / width


def photographs(n: int, seed: int = 0) -> list[torch.Tensor]:
    """``n`` crops (3, H, W) in [0, 1] of scikit-image's photographs, of aspect ratios from 1:3 to 3:1."""
    from skimage import data

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        img = np.asarray(getattr(data, PHOTOS[i % len(PHOTOS)])(), dtype=np.float32)
        img = img / 255.0 if img.max() > 1 else img
        img = np.repeat(img[..., None], 3, axis=2) if img.ndim == 2 else img[..., :3]
        h, w = img.shape[:2]
        ratio = RATIOS[rng.integers(len(RATIOS))]
        ch, cw = (h, int(h / ratio)) if h / ratio <= w else (int(w * ratio), w)
        top, left = rng.integers(0, h - ch + 1), rng.integers(0, w - cw + 1)
        out.append(torch.from_numpy(img[top:top + ch, left:left + cw]).permute(2, 0, 1).contiguous())
    return out


def resized(images: list[torch.Tensor], patch: int, budget: int) -> list[torch.Tensor]:
    """Each image at the size timm's NaFlex loader gives it for ``budget`` patches."""
    return [F.interpolate(img[None], size=budget_size(*img.shape[-2:], patch, budget), mode="bilinear",
                          antialias=True, align_corners=False)[0] for img in images]


def timm_batches(images: list[torch.Tensor], patch: int, budget: int, batch: int) -> list[dict]:
    """timm NaFlex's input: each image's patches (channels last, timm's order), coordinates and validity, padded to
    the budget, ``batch`` images at a time."""
    out = []
    for start in range(0, len(images), batch):
        chunk = images[start:start + batch]
        patches = torch.zeros(len(chunk), budget, patch * patch * 3)
        coord = torch.zeros(len(chunk), budget, 2, dtype=torch.long)
        valid = torch.zeros(len(chunk), budget, dtype=torch.bool)
        for i, img in enumerate(chunk):
            rows, cols = img.shape[-2] // patch, img.shape[-1] // patch
            p = img.unfold(1, patch, patch).unfold(2, patch, patch).permute(1, 2, 3, 4, 0).reshape(rows * cols, -1)
            patches[i, :len(p)], valid[i, :len(p)] = p, True
            coord[i, :len(p)] = torch.stack(torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij"),
                                            -1).reshape(-1, 2)
        out.append({"patches": patches, "patch_coord": coord, "patch_valid": valid})
    return out


def seconds(fn, train: bool) -> float:
    """Wall time of ``fn`` (a list of logits): in inference without gradients; in training with the backward of
    each batch's summed logits, and the gradients cleared."""
    start = time.perf_counter()
    if train:
        for out in fn():
            out.float().sum().backward()
    else:
        with torch.no_grad():
            fn()
    return time.perf_counter() - start


def onnx_entries(model, chunks: list[list[torch.Tensor]], images: list[torch.Tensor], patch: int,
                 lengths: list[int], used: int) -> dict:
    """vitkit's two exports of ``model`` in onnxruntime: ``vitkit export --packed`` on each loader batch packed into
    sequences of each of ``lengths`` patches, and the per-image export (dynamic height and width) one image a call."""
    import tempfile

    from vitkit.deploy.export import OnnxModel, export_onnx
    from vitkit.deploy.export_packed import export_packed

    tmp, prefix = Path(tempfile.mkdtemp()), model.num_prefix_tokens
    export_packed(model, tmp / "packed.onnx")
    export_onnx(model, tmp / "image.onnx")
    packed_file, image_file = OnnxModel(tmp / "packed.onnx"), OnnxModel(tmp / "image.onnx")
    out = {}
    for tokens in lengths:
        batches = [pack(c, patch, tokens + prefix, prefix) for c in chunks]
        arrays = [(b.patches.numpy(), b.image.numpy(), b.index.numpy(), np.asarray(b.grids, dtype=np.int64))
                  for b in batches]
        share = 1 - used / sum(b.image.numel() - len(b) * prefix for b in batches)
        out[f"vitkit --packed export, onnxruntime, {tokens + prefix} tokens a sequence"] = (
            lambda xs=arrays: [packed_file.run_packed(*x) for x in xs], share)
    out["vitkit's per-image export, onnxruntime, one image a call"] = (
        lambda: [image_file(img[None].numpy()) for img in images], 0.0)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=48)
    p.add_argument("--budget", type=int, default=256, help="patches per image (16 px)")
    p.add_argument("--max-tokens", default="256,512,1024", help="vitkit's packed sequence lengths without the "
                   "prefix tokens, comma-separated")
    p.add_argument("--batch", type=int, default=8, help="images per batch, for every entry (a loader's batch)")
    p.add_argument("--train", action="store_true", help="time forward and backward (training) instead of inference")
    p.add_argument("--flex", action="store_true", help="also the packed sequences on the flex backend (inference)")
    p.add_argument("--onnx", action="store_true", help="also vitkit's exports in onnxruntime (inference): the "
                   "--packed file on the longest packed sequences, and the per-image file one image a call")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    torch.manual_seed(0)
    import timm

    patch = 16
    images = resized(photographs(a.images), patch, a.budget)
    side = int(a.budget ** 0.5) * patch
    square = torch.stack([F.interpolate(img[None], size=(side, side), mode="bilinear", antialias=True)[0]
                          for img in images])
    theirs = timm.create_model("naflexvit_base_patch16_gap", pretrained=False, num_classes=1000)
    ours = vitkit.create_model("naflexvit_base_patch16_gap", num_classes=1000)  # timm's weights, vitkit's model
    ours.load_state_dict(to_vitkit(theirs.state_dict())[0])
    square_model = vitkit.create_model("naflexvit_base_patch16_gap", num_classes=1000, img_size=side)
    square_model.load_state_dict(ours.state_dict())
    for m in (theirs, ours, square_model):
        m.train(a.train)
    prefix = ours.num_prefix_tokens
    chunks = [images[i:i + a.batch] for i in range(0, len(images), a.batch)]
    padded = timm_batches(images, patch, a.budget, a.batch)
    used = sum((img.shape[-2] // patch) * (img.shape[-1] // patch) for img in images)
    entries = {}
    for tokens in map(int, a.max_tokens.split(",")):
        packed = [pack(c, patch, tokens + prefix, prefix) for c in chunks]
        share = 1 - used / sum(b.image.numel() - len(b) * prefix for b in packed)
        entries[f"vitkit packed, {tokens + prefix} tokens a sequence"] = (
            lambda bs=packed: [ours.forward_packed(b) for b in bs], share)
        if a.flex and not a.train and tokens == max(map(int, a.max_tokens.split(","))):
            flex = copy.deepcopy(ours)
            flex.set_attn_backend("flex")
            entries[f"vitkit packed, {tokens + prefix} tokens, flex"] = (
                lambda bs=packed, m=flex: [m.forward_packed(b) for b in bs], share)
    if a.onnx and not a.train:
        entries.update(onnx_entries(ours, chunks, images, patch, list(map(int, a.max_tokens.split(","))), used))
    naflex = [from_naflex(b, patch, prefix) for b in padded]
    entries[f"vitkit on timm's padded batches ({a.budget})"] = (
        lambda: [ours.forward_packed(b) for b in naflex], 1 - used / (len(images) * a.budget))
    entries[f"timm NaFlex, padded to {a.budget}"] = (lambda: [theirs(b) for b in padded],
                                                     1 - used / (len(images) * a.budget))
    entries[f"vitkit, square {side} px"] = (
        lambda: [square_model(square[i:i + a.batch]) for i in range(0, len(square), a.batch)], 0.0)
    for fn, _ in entries.values():  # warm-up: the attention's first-call timing, allocations
        seconds(fn, a.train)
    times: dict[str, list[float]] = {k: [] for k in entries}
    for _ in range(a.rounds):
        for name, (fn, _) in entries.items():
            times[name].append(seconds(fn, a.train))
            for m in (theirs, ours, square_model):
                m.zero_grad(set_to_none=True)
    lines = [f"{'Training (forward and backward)' if a.train else 'Inference'}: {a.images} photographs in batches of "
             f"{a.batch}, {a.budget} patches of 16 px each at most (timm's resize), NaFlexViT-B/16 (timm's "
             f"naflexvit_base_patch16_gap, random weights, the same in every entry), fp32, "
             f"{device_name(torch.device('cpu'))}, median of {a.rounds} interleaved rounds", "",
             "| entry | padding share | images/s | x timm NaFlex |", "|---|---|---|---|"]
    ref = a.images / statistics.median(times[next(k for k in entries if k.startswith("timm"))])
    for name, (_, padding) in entries.items():
        rate = a.images / statistics.median(times[name])
        lines.append(f"| {name} | {padding:.1%} | {rate:.2f} | {rate / ref:.2f} |")
    publish("\n".join(lines), a.out)


if __name__ == "__main__":
    main()
