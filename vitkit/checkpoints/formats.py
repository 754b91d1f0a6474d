"""Every key remapping in one place: state dicts of timm, torchvision, transformers and the official
Swin / DeiT repositories, renamed to vitkit's (= timm's ViT and Swin) parameter names; timm's Eva class (DINOv3,
the RoPE ViTs) names LayerScale differently from its ViT.

A format is recognised by keys only it has; a rule list renames keys with regular expressions in order,
and separate query / key / value projections are fused into one ``qkv`` as the attention core expects.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import Tensor

Rules = list[tuple[str, str | Callable[[re.Match], str]]]  # (pattern, replacement) for re.sub

# Wrappers that training scripts put around the weights, in the order they are looked for.
WRAPPERS = ("state_dict", "model", "module", "model_state_dict", "encoder")  # encoder: I-JEPA
EMA_WRAPPERS = ("state_dict_ema", "model_ema", "ema")
PREFIXES = ("module.", "_orig_mod.")  # DDP / DataParallel and torch.compile
DROPPED = ("relative_position_index", "attn_mask")  # buffers other libraries persist; vitkit rebuilds them

TORCHVISION_VIT: Rules = [
    (r"^class_token$", "cls_token"),
    (r"^conv_proj\.", "patch_embed.proj."),
    (r"^encoder\.pos_embedding$", "pos_embed"),
    (r"^encoder\.layers\.encoder_layer_(\d+)\.", r"blocks.\1."),
    (r"\.ln_1\.", ".norm1."),
    (r"\.ln_2\.", ".norm2."),
    (r"\.self_attention\.in_proj_(weight|bias)$", r".attn.qkv.\1"),
    (r"\.self_attention\.out_proj\.", ".attn.proj."),
    (r"\.mlp\.(0|linear_1)\.", ".mlp.fc1."),
    (r"\.mlp\.(3|linear_2)\.", ".mlp.fc2."),
    (r"^encoder\.ln\.", "norm."),
    (r"^heads\.head\.", "head."),
]

TORCHVISION_SWIN: Rules = [  # features: 0 = stem, odd = stages, even >= 2 = patch merging before a stage
    (r"^features\.0\.0\.", "patch_embed.proj."),
    (r"^features\.0\.2\.", "patch_embed.norm."),
    (r"^features\.(\d+)\.(\d+)\.", lambda m: f"layers.{(int(m[1]) - 1) // 2}.blocks.{m[2]}."),
    (r"^features\.(\d+)\.(reduction|norm)\.", lambda m: f"layers.{int(m[1]) // 2}.downsample.{m[2]}."),
    (r"\.mlp\.0\.", ".mlp.fc1."),
    (r"\.mlp\.3\.", ".mlp.fc2."),
    (r"^head\.", "head.fc."),
]

OFFICIAL_SWIN: Rules = [  # microsoft/Swin-Transformer merges patches at the end of a stage, timm at the start
    (r"^layers\.(\d+)\.downsample\.", lambda m: f"layers.{int(m[1]) + 1}.downsample."),
    (r"^head\.", "head.fc."),
]

_HF_BLOCK: Rules = [  # transformers 4.x names, then 5.x names
    (r"\.layernorm_before\.", ".norm1."),
    (r"\.layernorm_after\.", ".norm2."),
    (r"\.attention\.(?:attention|self)\.(query|key|value)\.", r".attn.\1."),
    (r"\.attention\.([qkv])_proj\.", lambda m: f".attn.{dict(q='query', k='key', v='value')[m[1]]}."),
    (r"\.attention\.output\.dense\.", ".attn.proj."),
    (r"\.attention\.o_proj\.", ".attn.proj."),
    (r"\.attention\.(?:self\.|relative_position_bias\.)relative_position_bias_table$",
     ".attn.relative_position_bias_table"),
    (r"\.intermediate\.dense\.", ".mlp.fc1."),
    (r"\.output\.dense\.", ".mlp.fc2."),
]

TRANSFORMERS_VIT: Rules = [
    (r"^vit\.", ""),
    (r"^embeddings\.cls_token$", "cls_token"),
    (r"^embeddings\.position_embeddings$", "pos_embed"),
    (r"^embeddings\.patch_embeddings\.projection\.", "patch_embed.proj."),
    (r"^(?:encoder\.layer|layers)\.(\d+)\.", r"blocks.\1."),
    *_HF_BLOCK,
    (r"^layernorm\.", "norm."),
    (r"^classifier\.", "head."),
]

TRANSFORMERS_SWIN: Rules = [
    (r"^swin\.", ""),
    (r"^embeddings\.patch_embeddings\.projection\.", "patch_embed.proj."),
    (r"^embeddings\.norm\.", "patch_embed.norm."),
    (r"^encoder\.layers\.(\d+)\.downsample\.", lambda m: f"layers.{int(m[1]) + 1}.downsample."),
    (r"^encoder\.layers\.(\d+)\.blocks\.", r"layers.\1.blocks."),
    *_HF_BLOCK,
    (r"^layernorm\.", "norm."),
    (r"^classifier\.", "head.fc."),
]


TIMM_EVA: Rules = [  # timm's Eva class (DINOv3, the RoPE ViTs, EVA-02): LayerScale as bare gammas, and EVA-02 B/L's
    (r"\.gamma_1$", ".ls1.gamma"),  # separate q, k, v projections (no key bias), fused by fuse_qkv
    (r"\.gamma_2$", ".ls2.gamma"),
    (r"\.attn\.q_proj\.weight$", ".attn.query.weight"),
    (r"\.attn\.k_proj\.weight$", ".attn.key.weight"),
    (r"\.attn\.v_proj\.weight$", ".attn.value.weight"),
    (r"\.attn\.q_proj\.bias$", ".attn.q_bias"),
    (r"\.attn\.v_proj\.bias$", ".attn.v_bias"),
    (r"\.attn\.norm\.", ".attn.out_norm."),  # EVA-CLIP's sub-LN on the heads' output
]


def _has(sd: dict, pattern: str) -> bool:
    return any(re.search(pattern, k) for k in sd)


# name -> (recogniser, rules); the first recogniser that matches decides. timm/vitkit is the fallback.
FORMATS: dict[str, tuple[Callable[[dict], bool], Rules]] = {
    "torchvision-vit": (lambda sd: "conv_proj.weight" in sd and "encoder.pos_embedding" in sd, TORCHVISION_VIT),
    "torchvision-swin": (lambda sd: "features.0.0.weight" in sd, TORCHVISION_SWIN),
    "transformers-swin": (lambda sd: _has(sd, r"^(swin\.)?embeddings\.patch_embeddings\.projection\.")
                          and _has(sd, r"^(swin\.)?encoder\.layers\.\d+\.blocks\."), TRANSFORMERS_SWIN),
    "transformers-vit": (lambda sd: _has(sd, r"^(vit\.)?embeddings\.position_embeddings$"), TRANSFORMERS_VIT),
    "official-swin": (lambda sd: "layers.0.downsample.reduction.weight" in sd, OFFICIAL_SWIN),
    "timm-eva": (lambda sd: _has(sd, r"^blocks\.\d+\.(gamma_1|attn\.q_proj\.weight)$"), TIMM_EVA),
}


def unwrap(ckpt: dict, use_ema: bool = False) -> dict[str, Tensor]:
    """The state dict inside a training checkpoint (the dict itself when it is bare)."""
    if use_ema:
        for key in EMA_WRAPPERS:
            if isinstance(ckpt.get(key), dict):
                return ckpt[key]
        raise KeyError(f"use_ema=True but the checkpoint has none of {list(EMA_WRAPPERS)}; "
                       f"its top-level keys are {sorted(ckpt)[:12]}")
    for key in WRAPPERS:
        if isinstance(ckpt.get(key), dict) and any(isinstance(v, Tensor) for v in ckpt[key].values()):
            return ckpt[key]
    return ckpt


def strip_prefixes(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """Remove ``module.`` / ``_orig_mod.`` wherever a wrapper put them at the front of every key."""
    changed = True
    while changed and sd:
        changed = False
        for p in PREFIXES:
            if all(k.startswith(p) for k in sd):
                sd, changed = {k[len(p):]: v for k, v in sd.items()}, True
    return sd


def rename(sd: dict[str, Tensor], rules: Rules) -> dict[str, Tensor]:
    out = {}
    for k, v in sd.items():
        for pattern, repl in rules:
            k = re.sub(pattern, repl, k)
        out[k] = v
    return out


def fuse_qkv(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """``...attn.query/key/value.{weight,bias}`` -> ``...attn.qkv.{weight,bias}`` (rows q, then k, then v)."""
    out = {}
    for k, v in sd.items():
        m = re.match(r"(.*\.attn\.)(query|key|value)\.(weight|bias)$", k)
        if not m:
            out[k] = v
        elif m[2] == "query":
            parts = [sd.get(f"{m[1]}{p}.{m[3]}") for p in ("query", "key", "value")]
            if any(p is None for p in parts):
                raise KeyError(f"{m[1]}: found query but not key and value {m[3]}s to fuse")
            out[f"{m[1]}qkv.{m[3]}"] = torch.cat(parts, dim=0)
    return out


def split_packed_glu(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """timm's packed SwiGLU (``GluMlp``: one ``mlp.fc1`` of 2·hidden rows, the gate's first; EVA-02 Ti/S) ->
    ``mlp.fc1_g`` and ``mlp.fc1_x``. Told apart from a plain MLP by shape: its fc1 has twice the rows fc2 has
    columns."""
    out = dict(sd)
    for k, w in sd.items():
        m = re.match(r"(.*\.mlp\.)fc1\.weight$", k)
        fc2 = sd.get(f"{m[1]}fc2.weight") if m else None
        if m and fc2 is not None and w.dim() == 2 and w.shape[0] == 2 * fc2.shape[1]:
            for name in ("weight", "bias"):
                if f"{m[1]}fc1.{name}" in sd:
                    gate, value = out.pop(f"{m[1]}fc1.{name}").chunk(2, dim=0)
                    out[f"{m[1]}fc1_g.{name}"], out[f"{m[1]}fc1_x.{name}"] = gate, value
    return out


def detect(sd: dict[str, Tensor]) -> str:
    for name, (recognise, _) in FORMATS.items():
        if recognise(sd):
            return name
    return "timm"


def to_vitkit(sd: dict[str, Tensor]) -> tuple[dict[str, Tensor], str]:
    """Rename a bare state dict of any known format to vitkit's names; returns it and the format's name."""
    sd = strip_prefixes(sd)
    fmt = detect(sd)
    if fmt in FORMATS:
        sd = fuse_qkv(rename(sd, FORMATS[fmt][1]))
    sd = split_packed_glu(sd)
    return {k: v for k, v in sd.items() if not k.endswith(DROPPED)}, fmt
