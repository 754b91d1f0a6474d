"""Fitting pretrained weights to a model of another resolution, window, input channels or class count.

Each function takes a checkpoint tensor and the shape the model wants, and returns a tensor of that
shape; :func:`adapt` applies them to a whole state dict and says what it changed.
"""

from __future__ import annotations

import math

from torch import Tensor, nn

from ..layers.pos_embed import resample_abs_pos_embed, resize_rel_pos_table


def adapt_input_conv(weight: Tensor, in_chans: int) -> Tensor:
    """A first conv (out, 3, k, k) for ``in_chans`` inputs: summed for 1, tiled and rescaled for more."""
    dtype, w = weight.dtype, weight.float()
    c = w.shape[1]
    if in_chans == 1:
        w = w.sum(dim=1, keepdim=True)
    else:
        w = w.repeat(1, math.ceil(in_chans / c), 1, 1)[:, :in_chans] * (c / in_chans)
    return w.to(dtype)


HEADS = ("head.", "head_dist.")  # the classifier, and DeiT's distillation head
ZERO_BIASES = (".attn.q_bias", ".attn.v_bias", ".attn.qkv.bias")  # dropped when all zeros and the model has none


def classifier_names(model: nn.Module) -> str | tuple[str, str]:
    """timm's ``pretrained_cfg["classifier"]``: the head's module name (both of DeiT's)."""
    if getattr(model, "head_dist", None) is not None:
        return ("head", "head_dist")
    return "head.fc" if hasattr(model.head, "fc") else "head"


def head_keys(model: nn.Module) -> set[str]:
    """The classifier's parameter names: ``head.*`` (ViT; DeiT's ``head_dist.*`` too) or ``head.fc.*`` (Swin)."""
    return {k for k in model.state_dict() if k.startswith(HEADS)}


def headless(sd: dict[str, Tensor]) -> bool:
    """A backbone saved without a classifier (self-supervised weights, image towers, ``num_classes=0`` exports)."""
    return not any(k.startswith("head.") for k in sd)


def adapt(sd: dict[str, Tensor], model: nn.Module) -> tuple[dict[str, Tensor], list[str]]:
    """Make ``sd`` fit ``model`` where a known change of resolution, window, input channels or classes
    explains a shape difference; returns the new state dict and one note per change made. A checkpoint with
    no classifier at all leaves the model's own, freshly initialised one (as timm does for a new head)."""
    target = model.state_dict()
    sd, notes = dict(sd), []
    cfg = getattr(model, "cfg", None)
    heads = head_keys(model)
    if heads and headless(sd):
        notes.append("head: new (not in the checkpoint)")
    pools_own_norm = "fc_norm.weight" in target and "norm.weight" not in target
    if pools_own_norm and "fc_norm.weight" not in sd and "norm.weight" in sd:
        # a backbone that pooled its class token after the final norm, for a model that pools by average with its
        # own norm after pooling: the final norm goes, fc_norm starts fresh, as MAE and BEiT fine-tune
        for k in ("norm.weight", "norm.bias"):
            sd.pop(k, None)
        notes.append("norm: dropped, and fc_norm new: the model pools by average with its own norm (fc_norm)")
    for k, v in list(sd.items()):
        want = target.get(k)
        if want is None and k.endswith(ZERO_BIASES) and not v.any():  # DINOv3 S/B/L: trained with zero biases
            del sd[k]
            notes.append(f"{k}: dropped, all zeros, and the model has no such bias")
            continue
        if want is None and k.startswith(HEADS) and not heads:
            del sd[k]
            notes.append(f"{k}: dropped, the model has no classifier (num_classes=0)")
            continue
        if want is None or tuple(v.shape) == tuple(want.shape):
            continue
        if k == "pos_embed" and v.dim() == 3 and v.shape[-1] == want.shape[-1]:
            prefix = 0 if cfg.no_embed_class else model.num_prefix_tokens
            sd[k] = resample_abs_pos_embed(v, cfg.grid_size, num_prefix_tokens=prefix)
            old = math.isqrt(v.shape[1] - prefix)
            notes.append(f"pos_embed: resampled (bicubic) from a {old}x{old} to a "
                         f"{cfg.grid_size[0]}x{cfg.grid_size[1]} patch grid, {prefix} prefix token(s) kept")
        elif k.endswith("relative_position_bias_table") and v.shape[-1] == want.shape[-1]:
            window = model.get_submodule(k.rsplit(".", 1)[0]).rel_pos_window
            sd[k] = resize_rel_pos_table(v, window)
            notes.append(f"{k}: relative-position table resized from {tuple(v.shape)} to window {tuple(window)}")
        elif k == "patch_embed.proj.weight" and v.shape[0] == want.shape[0] and v.shape[2:] == want.shape[2:]:
            sd[k] = adapt_input_conv(v, want.shape[1])
            notes.append(f"{k}: adapted from {v.shape[1]} to {want.shape[1]} input channels")
        elif k in heads:
            del sd[k]
            notes.append(f"{k}: new classifier {tuple(want.shape)} (checkpoint has {tuple(v.shape)}), "
                         "initialised fresh")
    return sd, notes
