"""A transformers ``config.json`` read as a vitkit preset and its overrides: ViT, DINOv2 (with registers),
DINOv3, Swin, Swin V2, and the image towers of CLIP and SigLIP (a whole image-text model's file included).

transformers may leave a field at its default out of the file, so every field is read with transformers'
default for it. What vitkit has no equivalent for is refused by name.
"""

from __future__ import annotations

from .files import CheckpointError

ACTS = {"gelu": "gelu", "quick_gelu": "quick_gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}


def _ratio(hidden: int, dim: int) -> float:
    """An MLP ratio whose ``int(dim * ratio)`` is ``hidden`` (SigLIP So400m: 4304 / 1152 is not exact in floats)."""
    return (hidden + 0.5) / dim


def _act(config: dict, default: str) -> str:
    act = config.get("hidden_act", default)
    if act not in ACTS:
        raise CheckpointError(f"transformers config has hidden_act={act!r}; vitkit's MLPs take {sorted(ACTS)}")
    return ACTS[act]


def _vit_common(config: dict, patch: int, size: int, eps: float) -> dict:
    dim = config.get("hidden_size", 768)
    return dict(img_size=config.get("image_size", size), patch_size=config.get("patch_size", patch),
                in_chans=config.get("num_channels", 3), embed_dim=dim, depth=config.get("num_hidden_layers", 12),
                num_heads=config.get("num_attention_heads", 12), norm_eps=config.get("layer_norm_eps", eps),
                mlp_ratio=_ratio(config.get("intermediate_size", 3072), dim))


def _clip(config: dict) -> tuple[str, dict]:  # the classifier is the projection, if the file has one
    return "vit_base_patch16_clip_224", dict(_vit_common(config, 32, 224, 1e-5), act_layer=_act(config, "quick_gelu"))


def _siglip(config: dict) -> tuple[str, dict]:
    over = _vit_common(config, 16, 224, 1e-6)
    pool = "map" if config.get("vision_use_head", True) else "avg"
    return "vit_base_patch16_siglip_224", dict(over, act_layer=_act(config, "gelu_pytorch_tanh"), global_pool=pool)


def _dinov2(config: dict, registers: bool) -> tuple[str, dict]:
    over = _vit_common(config, 14, 518, 1e-6)
    over.update(qkv_bias=config.get("qkv_bias", True), init_values=config.get("layerscale_value", 1.0),
                act_layer=_act(config, "gelu"))
    if config.get("use_swiglu_ffn"):  # transformers' SwiGLU width, rounded to 8 as DINOv2's
        hidden = (int(over["embed_dim"] * config.get("mlp_ratio", 4) * 2 / 3) + 7) // 8 * 8
        over.update(mlp_layer="swiglu", mlp_ratio=_ratio(hidden, over["embed_dim"]))
    else:
        over["mlp_ratio"] = config.get("mlp_ratio", 4)
    if registers:
        over.update(reg_tokens=config.get("num_register_tokens", 4), no_embed_class=True)
    return "vit_small_patch14_reg4_dinov2" if registers else "vit_small_patch14_dinov2", over


def _dinov3(config: dict) -> tuple[str, dict]:
    over = _vit_common(config, 16, 224, 1e-5)
    q, k, v = (config.get(f"{p}_bias", d) for p, d in (("query", True), ("key", False), ("value", True)))
    if not (q == k == v or (q and v and not k)):
        raise CheckpointError(f"transformers DINOv3 with query_bias={q}, key_bias={k}, value_bias={v}; vitkit's "
                              "attention has all three, none, or query and value")
    over.update(qkv_bias=(q if q == k else "qv"), reg_tokens=config.get("num_register_tokens", 0),
                rope_temperature=config.get("rope_theta", 100.0), init_values=config.get("layerscale_value", 1.0),
                mlp_layer="swiglu" if config.get("use_gated_mlp") else "mlp")
    act = config.get("hidden_act", "gelu")
    if config.get("use_gated_mlp") and act != "silu":
        raise CheckpointError(f"transformers DINOv3 with a gated MLP and hidden_act={act!r}; vitkit's gated MLP is "
                              "SwiGLU (silu), as DINOv3's S+/H+/7B")
    if not config.get("mlp_bias", True) or not config.get("proj_bias", True):
        raise CheckpointError("transformers DINOv3 without MLP or output-projection biases has no vitkit equivalent")
    return "vit_small_patch16_dinov3", over


def _swin(config: dict, version: int) -> tuple[str, dict]:
    if config.get("use_absolute_embeddings"):
        raise CheckpointError("transformers Swin with use_absolute_embeddings=True has no vitkit equivalent")
    over = dict(img_size=config.get("image_size", 224), patch_size=config.get("patch_size", 4),
                in_chans=config.get("num_channels", 3), embed_dim=config.get("embed_dim", 96),
                depths=tuple(config.get("depths", (2, 2, 6, 2))),
                num_heads=tuple(config.get("num_heads", (3, 6, 12, 24))),
                window_size=config.get("window_size", 7), mlp_ratio=config.get("mlp_ratio", 4.0),
                qkv_bias=config.get("qkv_bias", True), norm_eps=config.get("layer_norm_eps", 1e-5))
    if version == 1:  # transformers pads a map to whole windows with zeros that attention sees, as the official
        return "swin_tiny_patch4_window7_224", {**over, "attend_padding": True}  # detection backbone does
    pretrained = tuple(config.get("pretrained_window_sizes", (0,) * len(over["depths"])))
    if any(pretrained):
        over["pretrained_window_sizes"] = tuple(w or over["window_size"] for w in pretrained)
    return "swinv2_tiny_window8_256", over


def preset_for(config: dict) -> tuple[str, dict]:
    """The vitkit preset and overrides of a transformers ``config.json`` (the class count comes from the weights'
    classifier, as for every file)."""
    kind = config.get("model_type")
    if kind in ("clip", "siglip"):  # a whole image-text model: its image tower
        config = config.get("vision_config") or {}
    if kind not in ("vit", "vit_mae", "deit", "clip", "clip_vision_model", "siglip", "siglip_vision_model", "dinov2",
                    "dinov2_with_registers", "dinov3_vit", "swin", "swinv2"):
        raise CheckpointError(f"config.json has model_type={kind!r}; vitkit reads vit, vit_mae, deit, dinov2, "
                              "dinov2_with_registers, dinov3_vit, swin, swinv2, clip and siglip")
    if kind in ("clip", "clip_vision_model"):
        name, over = _clip(config)
    elif kind in ("siglip", "siglip_vision_model"):
        name, over = _siglip(config)
    elif kind.startswith("dinov2"):
        name, over = _dinov2(config, registers=kind == "dinov2_with_registers")
    elif kind == "dinov3_vit":
        name, over = _dinov3(config)
    elif kind.startswith("swin"):
        name, over = _swin(config, version=2 if kind == "swinv2" else 1)
    else:
        over = _vit_common(config, 16, 224, 1e-12)
        over.update(qkv_bias=config.get("qkv_bias", True), act_layer=_act(config, "gelu"))
        name = "deit_base_distilled_patch16_224" if kind == "deit" else "vit_base_patch16_224"  # deit: distilled
    return name, over


def mim_config(config: dict | None, raw: dict) -> dict:
    """The pre-training heads' settings a file records: a transformers ViTMAE config.json's decoder and masking,
    or the hyper-parameters of vitkit's own pre-training checkpoint (fields of ``MAEConfig`` / ``SimMIMConfig``)."""
    hp = raw.get("hyper_parameters") if isinstance(raw, dict) else None
    if isinstance(hp, dict) and hp.get("objective"):
        keys = ("objective", "mask_ratio", "decoder_embed_dim", "decoder_depth", "decoder_num_heads",
                "decoder_mlp_ratio", "norm_pix_loss", "mask_patch_size")
        return {k: hp[k] for k in keys if hp.get(k) is not None}
    if not config or config.get("model_type") != "vit_mae":
        return {}
    dim = config.get("decoder_hidden_size", 512)
    return dict(objective="mae", mask_ratio=config.get("mask_ratio", 0.75), decoder_embed_dim=dim,
                decoder_depth=config.get("decoder_num_hidden_layers", 8),
                decoder_num_heads=config.get("decoder_num_attention_heads", 16),
                decoder_mlp_ratio=_ratio(config.get("decoder_intermediate_size", 2048), dim),
                norm_pix_loss=config.get("norm_pix_loss", False), norm_eps=config.get("layer_norm_eps", 1e-12))
