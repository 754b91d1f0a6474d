"""Every key remapping in one place: state dicts of timm, torchvision, transformers (ViT, Swin, Swin V2, CLIP,
SigLIP, DINOv2, DINOv3, DeiT), OpenAI CLIP / OpenCLIP and the official Swin / DeiT / DINOv2 / DINOv3 repositories,
renamed to vitkit's (= timm's ViT and Swin) parameter names; timm's Eva class (DINOv3, the RoPE ViTs, EVA-02) names
LayerScale differently from its ViT.

A format is recognised by keys only it has. Its ``prepare`` step (if any) keeps the image tower of an image-text
file and reshapes what is not a rename (a projection matrix into a classifier, a packed pooling attention); its
rule list then renames keys with regular expressions in order; separate query / key / value projections are fused
into one ``qkv`` as the attention core expects; class, register and position tokens get their (1, N, D) shape.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from vitkit.errors import UsageError

Rules = list[tuple[str, str | Callable[[re.Match], str]]]  # (pattern, replacement) for re.sub

# Wrappers that training scripts put around the weights, in the order they are looked for.
WRAPPERS = ("state_dict", "model", "module", "model_state_dict", "encoder")  # encoder: I-JEPA
EMA_WRAPPERS = ("state_dict_ema", "model_ema", "ema")
PREFIXES = ("module.", "_orig_mod.")  # DDP / DataParallel and torch.compile
# buffers other libraries persist (vitkit rebuilds them) and pretraining-only tensors (masked-image tokens)
DROPPED = ("relative_position_index", "relative_coords_table", "attn_mask", "position_ids", "mask_token",
           "rope_embed.periods", ".bias_mask", ".inv_freq", "rope.freqs_cos", "rope.freqs_sin")
TOKENS = ("cls_token", "reg_token", "pos_embed", "attn_pool.latent")  # (1, N, D) in vitkit; 1-D or 2-D elsewhere

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

QKV = dict(q="query", k="key", v="value")

_HF_BLOCK: Rules = [  # transformers 4.x names, then 5.x names
    (r"\.layernorm_before\.", ".norm1."),
    (r"\.layernorm_after\.", ".norm2."),
    (r"\.attention\.(?:attention|self)\.(query|key|value)\.", r".attn.\1."),
    (r"\.attention\.([qkv])_proj\.", lambda m: f".attn.{QKV[m[1]]}."),
    (r"\.attention\.output\.dense\.", ".attn.proj."),
    (r"\.attention\.o_proj\.", ".attn.proj."),
    (r"\.attention\.(?:self\.|relative_position_bias\.)relative_position_bias_table$",
     ".attn.relative_position_bias_table"),
    (r"\.intermediate\.dense\.", ".mlp.fc1."),
    (r"\.output\.dense\.", ".mlp.fc2."),
]

TRANSFORMERS_VIT: Rules = [  # ViT, DeiT (distilled) and DINOv2 (with registers too)
    (r"^(?:vit|deit)\.", ""),  # (DINOv2's ``dinov2.`` goes in _hf_dinov2, before its registers are folded)
    (r"^embeddings\.cls_token$", "cls_token"),
    (r"^embeddings\.distillation_token$", "dist_token"),
    (r"^embeddings\.register_tokens$", "reg_token"),
    (r"^embeddings\.position_embeddings$", "pos_embed"),
    (r"^embeddings\.patch_embeddings\.projection\.", "patch_embed.proj."),
    (r"^(?:encoder\.layer|layers)\.(\d+)\.", r"blocks.\1."),
    *_HF_BLOCK,
    (r"\.layer_scale([12])\.lambda1$", r".ls\1.gamma"),
    (r"\.mlp\.weights_in\.", ".mlp.fc1."),  # DINOv2-g's packed SwiGLU, split by split_packed_glu
    (r"\.mlp\.weights_out\.", ".mlp.fc2."),
    (r"^layernorm\.", "norm."),
    (r"^(?:cls_)?classifier\.", "head."),
    (r"^distillation_classifier\.", "head_dist."),
]

TRANSFORMERS_SWIN: Rules = [  # Swin and Swin V2
    (r"^swin(?:v2)?\.", ""),
    (r"^embeddings\.patch_embeddings\.projection\.", "patch_embed.proj."),
    (r"^embeddings\.norm\.", "patch_embed.norm."),
    (r"^encoder\.layers\.(\d+)\.downsample\.", lambda m: f"layers.{int(m[1]) + 1}.downsample."),
    (r"^encoder\.layers\.(\d+)\.blocks\.", r"layers.\1.blocks."),
    (r"\.attention\.self\.logit_scale$", ".attn.logit_scale"),
    (r"\.attention\.self\.continuous_position_bias_mlp\.", ".attn.cpb_mlp."),
    *_HF_BLOCK,
    (r"^layernorm\.", "norm."),
    (r"^classifier\.", "head.fc."),
]

TRANSFORMERS_TOWER: Rules = [  # CLIP and SigLIP image towers (after _image_tower kept them)
    (r"^embeddings\.class_embedding$", "cls_token"),
    (r"^embeddings\.patch_embedding\.", "patch_embed.proj."),
    (r"^embeddings\.position_embedding\.weight$", "pos_embed"),
    (r"^pre_layrnorm\.", "norm_pre."),
    (r"^encoder\.layers\.(\d+)\.", r"blocks.\1."),
    (r"\.layer_norm([12])\.", r".norm\1."),
    (r"\.self_attn\.([qkv])_proj\.", lambda m: f".attn.{QKV[m[1]]}."),
    (r"\.self_attn\.out_proj\.", ".attn.proj."),
    (r"^post_layernorm\.", "norm."),
    (r"^head\.probe$", "attn_pool.latent"),  # SigLIP's attention-pool head (MAP)
    (r"^head\.attention\.out_proj\.", "attn_pool.proj."),
    (r"^head\.layernorm\.", "attn_pool.norm."),
    (r"^head\.mlp\.", "attn_pool.mlp."),
]

TRANSFORMERS_DINOV3: Rules = [
    (r"^embeddings\.cls_token$", "cls_token"),
    (r"^embeddings\.register_tokens$", "reg_token"),
    (r"^embeddings\.patch_embeddings\.", "patch_embed.proj."),
    (r"^(?:model\.)?layer\.(\d+)\.", r"blocks.\1."),
    *_HF_BLOCK,
    (r"\.layer_scale([12])\.lambda1$", r".ls\1.gamma"),
    (r"\.mlp\.gate_proj\.", ".mlp.fc1_g."),
    (r"\.mlp\.gated_up_proj\.", ".mlp.fc1_x."),  # up_proj of a gated MLP, told apart by _dinov3_mlp
    (r"\.mlp\.up_proj\.", ".mlp.fc1."),
    (r"\.mlp\.down_proj\.", ".mlp.fc2."),
]

OPENAI_CLIP: Rules = [  # OpenAI's CLIP and OpenCLIP's own ViTs (after _image_tower kept ``visual.``)
    (r"^class_embedding$", "cls_token"),
    (r"^positional_embedding$", "pos_embed"),
    (r"^conv1\.", "patch_embed.proj."),
    (r"^ln_pre\.", "norm_pre."),
    (r"^ln_post\.", "norm."),
    (r"^transformer\.resblocks\.(\d+)\.", r"blocks.\1."),
    (r"\.ln_([12])\.", r".norm\1."),
    (r"\.attn\.in_proj_(weight|bias)$", r".attn.qkv.\1"),
    (r"\.attn\.out_proj\.", ".attn.proj."),
    (r"\.mlp\.c_fc\.", ".mlp.fc1."),
    (r"\.mlp\.c_proj\.", ".mlp.fc2."),
]

# timm's Eva class (DINOv3, the RoPE ViTs, EVA-02) and baaivision/EVA's files: LayerScale as bare gammas, EVA-02's
# separate q, k, v projections (no key bias), fused by fuse_qkv
TIMM_EVA: Rules = [
    (r"\.gamma_1$", ".ls1.gamma"),
    (r"\.gamma_2$", ".ls2.gamma"),
    (r"\.attn\.([qkv])_proj\.", lambda m: f".attn.{QKV[m[1]]}."),
    (r"\.attn\.norm\.", ".attn.out_norm."),  # EVA-CLIP's sub-LN on the heads' output
    (r"\.attn\.inner_attn_ln\.", ".attn.out_norm."),  # baaivision/EVA's own names for the same
    (r"\.mlp\.ffn_ln\.", ".mlp.norm."),
    (r"\.mlp\.w12\.", ".mlp.fc1."),  # packed, split by split_packed_glu
    (r"\.mlp\.w1\.", ".mlp.fc1_g."),
    (r"\.mlp\.w2\.", ".mlp.fc1_x."),
    (r"\.mlp\.w3\.", ".mlp.fc2."),
]


def timm_layout(sd: dict[str, Tensor], theirs: dict[str, torch.Size]) -> dict[str, Tensor]:
    """``sd`` (vitkit's names) in the names of timm's model of the same preset, whose keys and shapes are
    ``theirs``: the inverse of TIMM_EVA where timm's Eva class keeps LayerScale as bare gammas, EVA-02's q, k, v as
    separate projections (no key bias) and the packed SwiGLU as one ``mlp.fc1``. Keys timm has under vitkit's name
    stay as they are, so for timm's ViT and Swin nothing changes; NaFlexViT's take its ``embeds`` names and
    shapes."""
    out: dict[str, Tensor] = {}
    for k, v in sd.items():
        if k in theirs:
            out[k] = v
            continue
        if f"embeds.{k.replace('patch_embed.proj.', 'proj.')}" in theirs:  # NaFlexViT's (_timm_naflex's inverse)
            mine = k.replace("patch_embed.proj.", "proj.")
            out[f"embeds.{mine}"] = v.permute(0, 2, 3, 1).flatten(1) if v.dim() == 4 else \
                v.reshape(theirs[f"embeds.{mine}"])
            continue
        m = re.match(r"(.*)\.ls([12])\.gamma$", k)
        if m and f"{m[1]}.gamma_{m[2]}" in theirs:
            out[f"{m[1]}.gamma_{m[2]}"] = v
        elif (m := re.match(r"(.*\.attn\.)out_norm\.(.*)$", k)) and f"{m[1]}norm.{m[2]}" in theirs:
            out[f"{m[1]}norm.{m[2]}"] = v
        elif (m := re.match(r"(.*\.attn\.)qkv\.weight$", k)) and f"{m[1]}q_proj.weight" in theirs:
            sizes = [theirs[f"{m[1]}{p}_proj.weight"][0] for p in "qkv"]
            for p, part in zip("qkv", v.split(sizes), strict=True):
                out[f"{m[1]}{p}_proj.weight"] = part
        elif (m := re.match(r"(.*\.attn\.)([qv])_bias$", k)) and f"{m[1]}{m[2]}_proj.bias" in theirs:
            out[f"{m[1]}{m[2]}_proj.bias"] = v
        elif (m := re.match(r"(.*\.mlp\.)fc1_([gx])\.(weight|bias)$", k)) and f"{m[1]}fc1.{m[3]}" in theirs:
            if m[2] == "g":  # timm's GluMlp: [gate | value] rows in one layer
                out[f"{m[1]}fc1.{m[3]}"] = torch.cat([v, sd[f"{m[1]}fc1_x.{m[3]}"]])
        else:
            out[k] = v
    return out


OFFICIAL_DINO: Rules = [  # facebookresearch/dinov2 and dinov3 (their SwiGLU: w12 packed or w1, w2; then w3)
    (r"^register_tokens$", "reg_token"),
    (r"^storage_tokens$", "reg_token"),
    (r"\.mlp\.w12\.", ".mlp.fc1."),
    (r"\.mlp\.w1\.", ".mlp.fc1_g."),
    (r"\.mlp\.w2\.", ".mlp.fc1_x."),
    (r"\.mlp\.w3\.", ".mlp.fc2."),
]

def _has(sd: dict, pattern: str) -> bool:
    return any(re.search(pattern, k) for k in sd)


def _image_tower(prefix: str, projection: str | None = None, bias: str | None = None,
                 transposed: bool = False) -> Callable[[dict], dict]:
    """Keep the image tower of an image-text file (its keys under ``prefix``, the prefix dropped; a file of the
    tower alone passes whole) and make its projection to the shared embedding vitkit's classifier: ``head``
    with a zero bias unless it has one, as timm's image towers have (OpenAI stores the matrix transposed)."""
    def keep(sd: dict[str, Tensor]) -> dict[str, Tensor]:
        inside = any(k.startswith(prefix) for k in sd)
        out = {k[len(prefix):] if inside else k: v for k, v in sd.items()
               if (k.startswith(prefix) or not inside) and k not in (projection, bias)}
        w = sd.get(projection) if projection else None
        if w is not None:
            out["head.weight"] = w.t() if transposed else w
            out["head.bias"] = sd[bias] if bias in sd else w.new_zeros(out["head.weight"].shape[0])
        return out
    return keep


def _siglip(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """transformers' SigLIP: the tower, and its pooling attention's packed in_proj cut into the query and the
    key-value projections of vitkit's AttentionPool."""
    sd = _image_tower("vision_model.")(sd)
    for name in ("weight", "bias"):
        packed = sd.pop(f"head.attention.in_proj_{name}", None)
        if packed is not None:
            dim = packed.shape[0] // 3
            sd[f"attn_pool.q.{name}"], sd[f"attn_pool.kv.{name}"] = packed[:dim], packed[dim:]
    return sd


def _dinov3_mlp(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """transformers' DINOv3: ``up_proj`` is the value half of a gated MLP and the first layer of a plain one."""
    gated = _has(sd, r"\.mlp\.gate_proj\.")
    return {k.replace(".mlp.up_proj.", ".mlp.gated_up_proj.") if gated else k: v for k, v in sd.items()}


def _fold_class_position(sd: dict[str, Tensor], reg: str = "register_tokens", pos: str = "pos_embed",
                         cls: str = "cls_token") -> dict[str, Tensor]:
    """DINOv2 with registers stores one position for the class token and none for the registers; vitkit (as timm)
    adds the class token's into the token itself and keeps positions for the patches alone."""
    sd = dict(sd)
    if reg in sd and pos in sd and cls in sd:
        sd[cls] = sd[cls] + sd[pos][:, :1]
        sd[pos] = sd[pos][:, 1:]
    return sd


def _hf_dinov2(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """transformers' DINOv2 (``dinov2.`` inside an image classifier), its registers folded as Meta's."""
    sd = {k.removeprefix("dinov2."): v for k, v in sd.items()}
    return _fold_class_position(sd, "embeddings.register_tokens", "embeddings.position_embeddings",
                                "embeddings.cls_token")


def _official_dino(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """facebookresearch/dinov2, dinov3: registers folded (DINOv2); DINOv3's ``qkv.bias`` (its key third masked to
    zero) cut into q and v biases; the 7B's local-crop norm and EUPE's distillation projectors dropped."""
    sd = _fold_class_position(sd)
    out = {}
    for k, v in sd.items():
        if k.startswith(("local_cls_norm.", "projectors.")):
            continue
        if "storage_tokens" in sd and k.endswith(".attn.qkv.bias"):
            q, _, val = v.chunk(3)
            out[k.replace("qkv.bias", "q_bias")], out[k.replace("qkv.bias", "v_bias")] = q, val
            continue
        out[k] = v
    return out


def _timm_naflex(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """timm's NaFlexViT: its ``embeds`` module holds the tokens, the position grid (1, h, w, D) and a linear patch
    projection over each patch's pixels in (row, column, channel) order, which is vitkit's patch convolution
    (D, C, p, p) laid out again. The channel count is the first of 3, 1, 4, 2 that leaves square patches."""
    if "embeds.pos_embed_y" in sd or "embeds.norm.weight" in sd or "embeds.norm_input.weight" in sd:
        raise UsageError("this NaFlexViT file has factorized positions or a norm on the patch embedding "
                         "(embeds.pos_embed_y / embeds.norm), which vitkit does not build; its naflexvit_* "
                         "presets take learned 2-D positions")
    out = {k: v for k, v in sd.items() if not k.startswith("embeds.")}
    w = sd["embeds.proj.weight"]
    for chans in (3, 1, 4, 2):
        p = math.isqrt(w.shape[1] // chans)
        if w.shape[1] % chans == 0 and p * p * chans == w.shape[1]:
            break
    else:
        raise UsageError(f"embeds.proj.weight {tuple(w.shape)}: its {w.shape[1]} inputs are no square patch of "
                         "1 to 4 channels")
    out["patch_embed.proj.weight"] = w.reshape(w.shape[0], p, p, chans).permute(0, 3, 1, 2).contiguous()
    if "embeds.proj.bias" in sd:
        out["patch_embed.proj.bias"] = sd["embeds.proj.bias"]
    if "embeds.pos_embed" in sd:
        out["pos_embed"] = sd["embeds.pos_embed"].flatten(1, 2)
    for name in ("cls_token", "reg_token"):
        if f"embeds.{name}" in sd:
            out[name] = sd[f"embeds.{name}"]
    return out


class Format(NamedTuple):
    recognise: Callable[[dict], bool]
    rules: Rules
    prepare: Callable[[dict], dict] | None = None  # before renaming: keep the image tower, reshape
    embedding_head: bool = False  # its classifier is an image-text projection: outputs are an embedding, not classes


# name -> format; the first recogniser that matches decides. timm/vitkit is the fallback.
FORMATS: dict[str, Format] = {
    "torchvision-vit": Format(lambda sd: "conv_proj.weight" in sd and "encoder.pos_embedding" in sd, TORCHVISION_VIT),
    "torchvision-swin": Format(lambda sd: "features.0.0.weight" in sd, TORCHVISION_SWIN),
    "openai-clip": Format(lambda sd: _has(sd, r"^(visual\.)?class_embedding$") and _has(sd, r"^(visual\.)?conv1\."),
                          OPENAI_CLIP, _image_tower("visual.", "visual.proj", transposed=True), True),
    "openclip-timm": Format(lambda sd: _has(sd, r"^visual\.trunk\."), [],
                            _image_tower("visual.trunk.", "visual.head.proj.weight", "visual.head.proj.bias"), True),
    "transformers-clip": Format(lambda sd: _has(sd, r"^(vision_model\.)?embeddings\.class_embedding$"),
                                TRANSFORMERS_TOWER, _image_tower("vision_model.", "visual_projection.weight"), True),
    "transformers-siglip": Format(lambda sd: _has(sd, r"^(vision_model\.)?embeddings\.patch_embedding\.weight$"),
                                  TRANSFORMERS_TOWER, _siglip),
    "transformers-dinov3": Format(lambda sd: "embeddings.patch_embeddings.weight" in sd, TRANSFORMERS_DINOV3,
                                  _dinov3_mlp),
    "transformers-swinv2": Format(lambda sd: _has(sd, r"\.continuous_position_bias_mlp\."), TRANSFORMERS_SWIN),
    "transformers-swin": Format(lambda sd: _has(sd, r"^(swin\.)?embeddings\.patch_embeddings\.projection\.")
                                and _has(sd, r"^(swin\.)?encoder\.layers\.\d+\.blocks\."), TRANSFORMERS_SWIN),
    "transformers-vit": Format(lambda sd: _has(sd, r"^(vit\.|deit\.|dinov2\.)?embeddings\.position_embeddings$"),
                               TRANSFORMERS_VIT, _hf_dinov2),
    "official-swin": Format(lambda sd: "layers.0.downsample.reduction.weight" in sd, OFFICIAL_SWIN),
    "official-dinov3": Format(lambda sd: "storage_tokens" in sd, OFFICIAL_DINO, _official_dino),
    "official-dinov2": Format(lambda sd: "mask_token" in sd and _has(sd, r"^blocks\.0\.ls1\.gamma$"), OFFICIAL_DINO,
                              _official_dino),
    "timm-naflex": Format(lambda sd: "embeds.proj.weight" in sd, [], _timm_naflex),
    "timm-eva": Format(lambda sd: _has(sd, r"^blocks\.\d+\.(gamma_1|attn\.q_proj\.weight|mlp\.w12?\.weight)$"),
                       TIMM_EVA),
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


def rename_key(key: str, rules: Rules) -> str:
    """``key`` through every rule in turn."""
    for pattern, repl in rules:
        key = re.sub(pattern, repl, key)
    return key


def rename(sd: dict[str, Tensor], rules: Rules) -> dict[str, Tensor]:
    return {rename_key(k, rules): v for k, v in sd.items()}


def fuse_qkv(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """``...attn.query/key/value.{weight,bias}`` -> ``...attn.qkv.{weight,bias}`` (rows q, then k, then v);
    query and value biases without a key bias (BEiT's, Swin V2's, DINOv3's) -> ``q_bias`` and ``v_bias``."""
    out = {}
    for k, v in sd.items():
        m = re.match(r"(.*\.attn\.)(query|key|value)\.(weight|bias)$", k)
        if not m:
            out[k] = v
        elif m[2] == "query":
            q, key, val = (sd.get(f"{m[1]}{p}.{m[3]}") for p in ("query", "key", "value"))
            if m[3] == "bias" and key is None and val is not None:
                out[f"{m[1]}q_bias"], out[f"{m[1]}v_bias"] = q, val
            elif key is None or val is None:
                raise KeyError(f"{m[1]}: found query but not key and value {m[3]}s to fuse")
            else:
                out[f"{m[1]}qkv.{m[3]}"] = torch.cat([q, key, val], dim=0)
        elif m[3] == "bias" and f"{m[1]}query.bias" not in sd:
            raise KeyError(f"{m[1]}: found a {m[2]} bias but no query bias")
    return out


def shape_tokens(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """Class, register and position tokens and the pooling query as (1, N, D): other libraries keep them 1-D
    (a class embedding) or 2-D (an embedding table of positions); none of them when there are none."""
    return {k: v.reshape(1, -1, v.shape[-1]) if k in TOKENS and v.dim() < 3 else v for k, v in sd.items()
            if not (k in TOKENS and v.numel() == 0)}  # transformers keeps an empty (1, 0, D) for no registers


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
    for name, fmt in FORMATS.items():
        if fmt.recognise(sd):
            return name
    return "timm"


# -- masked image modeling: the pre-training heads beside the encoder -------------------------------------------------
# vitkit's own (MaskedAutoencoder, SimMIM) name the encoder ``encoder.*`` and keep their heads' names; Meta's MAE
# files hold timm's encoder names beside ``decoder_*`` and ``mask_token``, which vitkit's MAE names alike;
# transformers' ViTMAEForPreTraining, ViTForMaskedImageModeling and SwinForMaskedImageModeling nest them.
MAE_HEAD = re.compile(r"^(decoder_(embed|pos_embed|blocks|norm|pred)\b|mask_token$)")
TRANSFORMERS_MAE_DECODER: Rules = [
    # the hub's files (transformers 4) and what transformers 5 writes
    (r"^decoder\.(?:decoder_layers|decoder_encoder\.layer)\.(\d+)\.", r"decoder_blocks.\1."),
    (r"^decoder\.(decoder_embed|decoder_pos_embed|decoder_norm|decoder_pred|mask_token)", r"\1"),
    *_HF_BLOCK,
]


def split_pretraining_heads(sd: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor], str | None]:
    """(the encoder's state dict in its file's names, the pre-training heads in vitkit's names, the objective:
    "mae", "simmim", "dino" (the encoder is DINO's teacher) or None when the file has no such head)."""
    sd = strip_prefixes(sd)
    if any(k.startswith("teacher.") for k in sd) and any(k.startswith("student_head.") for k in sd):  # vitkit's DINO
        teacher = {k[len("teacher."):]: v for k, v in sd.items() if k.startswith("teacher.")}
        return teacher, {k: v for k, v in sd.items() if not k.startswith("teacher.")}, "dino"
    if any(k.startswith("encoder.") for k in sd) and ("decoder_pred.weight" in sd or "decoder.0.weight" in sd):
        encoder = {k[len("encoder."):]: v for k, v in sd.items() if k.startswith("encoder.")}
        heads = {k: v for k, v in sd.items() if not k.startswith("encoder.")}
        return encoder, heads, "mae" if "decoder_pred.weight" in sd else "simmim"
    if "decoder_pred.weight" in sd:  # Meta's MAE with its decoder (mae_visualize_*)
        return ({k: v for k, v in sd.items() if not MAE_HEAD.match(k)}, {k: v for k, v in sd.items()
                                                                           if MAE_HEAD.match(k)}, "mae")
    if "decoder.decoder_pred.weight" in sd:  # transformers' ViTMAEForPreTraining
        heads = fuse_qkv(rename({k: v for k, v in sd.items() if k.startswith("decoder.")}, TRANSFORMERS_MAE_DECODER))
        return {k: v for k, v in sd.items() if not k.startswith("decoder.")}, heads, "mae"
    token = next((k for k in sd if re.match(r"^(vit|swin)\.embeddings\.mask_token$", k)), None)
    if token is not None and "decoder.0.weight" in sd:  # transformers' ViT / Swin ForMaskedImageModeling
        heads = {"mask_token": sd[token], **{k: v for k, v in sd.items() if k.startswith("decoder.")}}
        return {k: v for k, v in sd.items() if k != token and not k.startswith("decoder.")}, heads, "simmim"
    return sd, {}, None


def to_vitkit(sd: dict[str, Tensor]) -> tuple[dict[str, Tensor], str]:
    """Rename a bare state dict of any known format to vitkit's names; returns it and the format's name."""
    sd = strip_prefixes(sd)
    fmt = detect(sd)
    if fmt in FORMATS:
        prepare = FORMATS[fmt].prepare
        sd = fuse_qkv(rename(prepare(sd) if prepare else sd, FORMATS[fmt].rules))
    sd = shape_tokens(split_packed_glu(sd))
    return {k: v for k, v in sd.items() if not k.endswith(DROPPED)}, fmt
