"""Pictures: attention maps over an image, training curves from a CSV log, position-embedding similarity,
masked-image-modeling reconstructions.

Each function writes one PNG and returns its path: matplotlib's Agg backend (no display needed) draws the
figures, Pillow the reconstruction grid, which a pre-training run draws every epoch.
"""

from __future__ import annotations

import csv
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no window), imported on first use."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def attention_rollout(maps: list[Tensor], num_prefix: int, grid: tuple[int, int]) -> Tensor:
    """Abnar & Zuidema (2020): average heads, add the residual (identity), renormalise, multiply through
    the layers; the first token's row over the patches is where the class token looks. (B, gh, gw)."""
    B, _, N, _ = maps[0].shape
    eye = torch.eye(N, device=maps[0].device)
    joint = eye.expand(B, N, N)
    for a in maps:
        a = a.float().mean(1) + eye  # (B, N, N)
        joint = (a / a.sum(-1, keepdim=True)) @ joint
    return joint[:, 0, num_prefix:].reshape(B, *grid)


def swin_window_attention(attn: Tensor, plan) -> Tensor:
    """Per-window attention of one Swin block -> how much attention each position receives (H, W).

    attn is (nW, heads, N, N) for one image; heads are averaged, each key's received attention is summed
    over the queries of its window and placed back where the window sits on the map."""
    nW = attn.shape[0]
    received = attn.float().mean(1).sum(1)  # (nW, N)
    window = received.view(1, nW, plan.window[0] * plan.window[1], 1)
    return plan.reverse(window)[0, :, :, 0]  # (H, W): shift undone, padding cropped


def overlay(image: Tensor, heat: Tensor, path: str | Path, title: str) -> Path:
    """image (C, H, W) in [0, 1], heat (h, w) any range -> PNG of the image and the upsampled heat map."""
    plt = pyplot()
    heat = F.interpolate(heat[None, None].float(), size=image.shape[-2:], mode="bilinear", align_corners=False)[0, 0]
    heat = (heat - heat.min()) / (heat.max() - heat.min() + 1e-8)
    img = image.permute(1, 2, 0).clamp(0, 1).cpu().numpy()
    fig, axes = plt.subplots(1, 2, figsize=(7, 3.6))
    axes[0].imshow(img.squeeze(), cmap="gray" if img.shape[-1] == 1 else None)
    axes[0].set_title("input", fontsize=9)
    axes[1].imshow(img.squeeze(), cmap="gray" if img.shape[-1] == 1 else None)
    axes[1].imshow(heat.cpu().numpy(), cmap="inferno", alpha=0.6)
    axes[1].set_title(title, fontsize=9)
    for ax in axes:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def learning_rate_series(rows: list[dict]) -> tuple[str | None, str]:
    """The LR column a curves panel draws, and its title: one column per param group (``lr-AdamW/pgN``), of which
    the largest is the base (the head's) and layer decay scales the others below it."""
    peak: dict[str, float] = {}
    for r in rows:
        for k, v in r.items():
            if k.startswith("lr-") and v not in (None, ""):
                peak[k] = max(peak.get(k, 0.0), float(v))
    if not peak:
        return None, "learning rate"
    top = max(peak, key=peak.__getitem__)
    below = sum(v < 0.999 * peak[top] for v in peak.values())
    return top, "learning rate" + (f"\n(the head's; {below} groups decayed below)" if below else "")


def training_curves(metrics_csv: str | Path, path: str | Path | None = None) -> Path:
    """Loss, top-1 (or exact match) and learning rate against the step, from a Lightning CSVLogger file."""
    plt = pyplot()
    metrics_csv = Path(metrics_csv)
    rows = list(csv.DictReader(metrics_csv.open()))

    def series(key: str) -> tuple[list[float], list[float]]:
        pts = [(float(r["step"]), float(r[key])) for r in rows if r.get(key) not in (None, "")]
        return [p[0] for p in pts], [p[1] for p in pts]

    keys = rows[0].keys() if rows else []
    lr_key, lr_title = learning_rate_series(rows)
    panels = [("loss", [k for k in ("train/loss_step", "train/loss_epoch", "val/loss") if k in keys]),
              ("accuracy", [k for k in ("val/top1", "val/top1_ema", "val/mAP", "val/mAP_ema", "val/exact_match",
                                        "val/token_acc") if k in keys]),
              (lr_title, [lr_key] if lr_key else [])]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    probe = [float(r["val/probe_baseline"]) for r in rows if r.get("val/probe_baseline") not in (None, "")]
    for ax, (title, ks) in zip(axes, panels, strict=True):
        for k in ks:
            x, y = series(k)
            ax.plot(x, y, marker="o" if k.startswith("val") or k.endswith("epoch") else None, ms=3, lw=1.2, label=k)
        if title == "accuracy" and probe:  # the probe on frozen features a small-data run started from
            ax.axhline(probe[-1], color="grey", ls="--", lw=1, label="val/probe_baseline")
            ks = [*ks, "val/probe_baseline"]
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        if ks:
            ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path) if path else metrics_csv.with_name("curves.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def pos_embed_similarity(models: dict[str, nn.Module], path: str | Path, rows: int = 4) -> Path:
    """Cosine similarity of each patch's position embedding with all others (Dosovitskiy et al., 2021,
    Fig. 7), for ViTs side by side, e.g. a learned and a fixed 2-D sin-cos embedding. Shows ``rows`` x
    ``rows`` evenly spaced query patches per model, each as a heat map over the patch grid."""
    plt = pyplot()
    fig, axes = plt.subplots(rows, rows * len(models), figsize=(2.2 * rows * len(models), 2.2 * rows))
    for m_i, (name, model) in enumerate(models.items()):
        gh, gw = model.cfg.grid_size
        pe = model.pos_embed.detach()[0, -gh * gw:].float()  # patches only (prefix positions dropped)
        pe = F.normalize(pe, dim=-1)
        sim = (pe @ pe.T).view(gh, gw, gh, gw)
        lo = float(sim.min())  # colours span each model's own range: sin-cos similarities stay high everywhere
        picks = [round(i * (gh - 1) / max(rows - 1, 1)) for i in range(rows)]
        pw = [round(j * (gw - 1) / max(rows - 1, 1)) for j in range(rows)]
        for i, r in enumerate(picks):
            for j, c in enumerate(pw):
                ax = axes[i, m_i * rows + j]
                ax.imshow(sim[r, c].numpy(), cmap="viridis", vmin=lo, vmax=1)
                ax.set_xticks([])
                ax.set_yticks([])
                if i == 0 and j == 0:
                    ax.set_title(f"{name}: cos sim {lo:.2f} .. 1", fontsize=9, loc="left")
    fig.suptitle("cosine similarity of position embeddings: one panel per query patch", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


GRID_GAP = 4  # px between the cells of a reconstruction grid


def cell_scale(h: int, w: int) -> int:
    """The whole factor a reconstruction grid draws an ``h`` x ``w`` image at: the least that makes it 96 px a
    side or more (1 for images already that large)."""
    return max(1, -(-96 // min(h, w)))


def reconstruction_grid(originals: Tensor, masked: Tensor, reconstructions: Tensor, path: str | Path,
                        title: str = "") -> Path:
    """Masked image modeling at a glance: a column per image, its original, masked input and reconstruction in
    rows; each (B, C, H, W) in [0, 1]. Drawn as one mosaic (Pillow, not a figure: a training run draws it every
    epoch, and a figure of 24 matplotlib panels costs a good part of a small recipe's epoch): the cells fill the
    bottom right, ``GRID_GAP`` px apart after each, every image scaled by the whole factor ``cell_scale``
    (nearest neighbour, at least 96 px a side); the rows are named on the left, the title above."""
    from PIL import Image, ImageDraw, ImageFont

    rows = (("original", originals), ("masked", masked), ("reconstruction", reconstructions))
    n, c, h, w = originals.shape
    scale = cell_scale(h, w)
    try:
        font = ImageFont.load_default(12)
    except TypeError:  # Pillow before 10.1: its one bitmap font
        font = ImageFont.load_default()
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))

    def size(text: str) -> tuple[int, int]:
        x0, y0, x1, y1 = measure.textbbox((0, 0), text, font=font)
        return int(x1 - x0), int(y1 - y0)

    cw, ch = w * scale + GRID_GAP, h * scale + GRID_GAP
    left = max(max(size(name)[0] for name, _ in rows) + 3 * GRID_GAP, size(title)[0] + 2 * GRID_GAP - n * cw)
    top = size(title)[1] + 3 * GRID_GAP if title else GRID_GAP
    canvas = Image.new("RGB", (left + n * cw, top + 3 * ch), "white")
    draw = ImageDraw.Draw(canvas)
    if title:
        draw.text(((canvas.width - size(title)[0]) // 2, GRID_GAP), title, fill="black", font=font)
    for r, (name, images) in enumerate(rows):
        y = top + r * ch
        draw.text((GRID_GAP, y + (h * scale - size(name)[1]) // 2), name, fill="black", font=font)
        images = images.expand(-1, 3, -1, -1) if c == 1 else images[:, :3]  # grey drawn as RGB
        pixels = (images.float().clamp(0, 1) * 255).round().to(torch.uint8)
        pixels = pixels.repeat_interleave(scale, 2).repeat_interleave(scale, 3).permute(0, 2, 3, 1).numpy()
        for i in range(n):
            canvas.paste(Image.fromarray(pixels[i]), (left + i * cw, y))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    canvas.save(path, format="PNG")
    return path


@torch.no_grad()
def draw_reconstructions(model: nn.Module, images: Tensor, masking: Tensor | None, mean, std, path: str | Path,
                         title: str = "") -> Path:
    """Original / masked / reconstruction of ``images`` (normalised with ``mean`` and ``std``) by a masked-image
    model (``reconstruct``: MAE's noise or SimMIM's mask, drawn when None), hidden patches grey."""
    was_training = model.training
    model.eval()
    masked, recon, hidden = model.reconstruct(images, masking)
    model.train(was_training)
    c = images.shape[1]
    m = torch.tensor(mean if mean is not None else (0.0,) * c, device=images.device)[:c].view(1, -1, 1, 1)
    s = torch.tensor(std if std is not None else (1.0,) * c, device=images.device)[:c].view(1, -1, 1, 1)

    def show(x: Tensor) -> Tensor:
        return (x.float() * s + m).clamp(0, 1).cpu()

    return reconstruction_grid(show(images), show(masked).masked_fill(hidden.cpu(), 0.5), show(recon), path, title)
