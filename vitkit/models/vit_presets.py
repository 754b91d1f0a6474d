"""The ViT presets: timm's names -> ViTConfig fields, one row each (``vitkit.models.registry`` lists them)."""

from __future__ import annotations

from .config import CLIP, IMAGENET, INCEPTION, RAW

# Sizes as in big_vision ("B/16" = Base width/depth/heads with 16-px patches): (embed_dim, depth, heads, mlp_ratio).
SIZES: dict[str, tuple[int, int, int, float]] = {
    "Ti": (192, 12, 3, 4.0), "S": (384, 12, 6, 4.0), "S36": (384, 36, 6, 4.0), "M": (512, 12, 8, 4.0),
    "Md": (512, 20, 8, 4.0), "Bx": (640, 12, 10, 4.0), "B": (768, 12, 12, 4.0), "B+": (896, 12, 14, 4.0),
    "L": (1024, 24, 16, 4.0), "H": (1280, 32, 16, 4.0), "g": (1408, 40, 16, 4.363636363636363),
    "G": (1664, 48, 16, 4.923076923076923), "Wee": (256, 14, 4, 5.0), "Little": (320, 14, 5, 5.6),
    "So150m": (896, 18, 14, 2.572), "So150m2": (832, 21, 13, 2.6153846153846154), "So400m": (1152, 27, 16, 3.7362),
    "So400mT": (1152, 27, 16, 3.736111111111111), "E": (1792, 64, 16, 15360 / 1792),
    "Xs": (256, 10, 4, 4.0), "Gopt": (1536, 40, 16, 4.0), "H+": (1280, 32, 20, 4.0), "7B": (4096, 40, 32, 2.0),
}

# DINOv3 (Siméoni et al., 2025): no learned positions, 2-D RoPE, 4 storage (register) tokens, LayerScale, LayerNorm
# eps 1e-5, any input size; timm pools the patch tokens (pass global_pool='token' for the class token) and ships no
# head. The _qkvb weights have q and v biases (keys none); S+, H+ and 7B use a SwiGLU MLP.
# CLIP's image towers: a LayerNorm before the blocks (and a patch conv without bias), LayerNorm eps 1e-5; the head is
# CLIP's projection (OpenAI's: act_layer="quick_gelu"). SigLIP's: no class token, the attention-pool head, no classifier.
CLIP_TOWER = dict(pre_norm=True, norm_eps=1e-05)
SIGLIP_MAP = dict(class_token=False, global_pool="map", num_classes=0)
SIGLIP_GAP = dict(class_token=False, global_pool="avg", fc_norm=False, num_classes=0)  # timm's average-pooled SigLIPs

# timm's RoPE ViTs: axial RoPE on the patches, no learned positions (_ape: learned ones too), LayerScale. The _224
# ones are NAVER's (Heo et al., 2024), the _gap_256 ones timm's own, with EVA's reference-grid rescaling.
ROPE = dict(pos_embed="none", rope="axial", init_values=1e-05)
ROPE_APE = dict(ROPE, pos_embed="learn")
# NAVER's RoPE-Mixed: learned frequencies per block and head (timm's rope.freqs), with or without learned positions.
ROPE_MIXED = dict(ROPE, rope="mixed", rope_temperature=10.0)
ROPE_MIXED_APE = dict(ROPE_MIXED, pos_embed="learn", no_embed_class=True)

# EVA-02 (Fang et al., 2024): learned positions and axial RoPE rescaled to the 16x16 pretraining grid, q and v biases,
# a SwiGLU MLP (hidden 8/3 of the width; Ti/S's stored packed, B/L's with a LayerNorm inside), average pooling. The
# EVA-CLIP towers also norm the heads' output before the projection, and pool the class token. EVA-02-E (enormous)
# is a plain ViT with q and v biases and residual post-norm blocks.
EVA02 = dict(mlp_ratio=4 * 2 / 3, mlp_layer="swiglu", qkv_bias="qv", rope="axial", rope_temperature=10000.0,
             rope_ref_grid=16, global_pool="avg")
EVA02_BL = dict(EVA02, mlp_norm=True)
EVA02_CLIP = dict(EVA02_BL, attn_norm=True, global_pool="token")

DINOV3 = dict(pos_embed="none", rope="dinov3", rope_temperature=100.0, reg_tokens=4, init_values=1e-05, norm_eps=1e-05,
              global_pool="avg", fc_norm=False, dynamic_img_size=True, num_classes=0)

# timm's NaFlexViT: a ViT for images of their own sizes. Learned positions on a 16 x 16 grid, resampled to each
# input's grid (par: the longer side's square, cropped), register tokens and no class token, the attention pool or
# the mean reading the patches alone, LayerScale. Its padded batches run as packed ones (packing.from_naflex).
NAFLEX = dict(class_token=False, no_embed_class=True, pos_grid=16, dynamic_img_size=True, map_prefix=False)
NAFLEX_GAP = dict(NAFLEX, init_values=1e-05, global_pool="avg", fc_norm=True)
NAFLEX_MAP = dict(NAFLEX, init_values=1e-05, global_pool="map", reg_tokens=1)
NAFLEX_SIGLIP = dict(NAFLEX, act_layer="gelu_tanh", global_pool="map", pos_interp="bilinear", num_classes=0)  # SigLIP 2's towers


def _row(size: str, img: int, data: dict, crop_pct: float, **kw) -> dict:
    width, patch = size.split("/")
    dim, depth, heads, mlp = SIZES[width]
    return dict(embed_dim=dim, depth=depth, num_heads=heads, mlp_ratio=mlp, patch_size=int(patch), img_size=img,
                crop_pct=crop_pct, **data) | kw


# Keyed by timm's names: every ViT/DeiT of timm's vision_transformer.py that this config expresses (same weights,
# same logits), CLIP's image towers and SigLIP's (attention-pooled) among them.
VIT_PRESETS: dict[str, dict] = {
    "eva02_base_patch14_224": _row("B/14", 224, CLIP, 0.9, **EVA02_BL, num_classes=0),
    "eva02_base_patch14_448": _row("B/14", 448, CLIP, 1.0, **EVA02_BL),
    "eva02_base_patch16_clip_224": _row("B/16", 224, CLIP, 0.9, **EVA02_CLIP, num_classes=512),
    "eva02_enormous_patch14_clip_224": _row("E/14", 224, CLIP, 0.9, qkv_bias="qv", res_post_norm=True,
                                            global_pool="token", num_classes=1024),
    "eva02_large_patch14_224": _row("L/14", 224, CLIP, 0.9, **EVA02_BL, num_classes=0),
    "eva02_large_patch14_448": _row("L/14", 448, CLIP, 1.0, **EVA02_BL),
    "eva02_large_patch14_clip_224": _row("L/14", 224, CLIP, 0.9, **EVA02_CLIP, num_classes=768),
    "eva02_large_patch14_clip_336": _row("L/14", 336, CLIP, 1.0, **EVA02_CLIP, num_classes=768),
    "eva02_small_patch14_224": _row("S/14", 224, CLIP, 0.9, **EVA02, num_classes=0),
    "eva02_small_patch14_336": _row("S/14", 336, CLIP, 1.0, **EVA02),
    "eva02_tiny_patch14_224": _row("Ti/14", 224, CLIP, 0.9, **EVA02, num_classes=0),
    "eva02_tiny_patch14_336": _row("Ti/14", 336, CLIP, 1.0, **EVA02),
    "deit3_base_patch16_224": _row("B/16", 224, IMAGENET, 0.9, no_embed_class=True, init_values=1e-06),
    "deit3_base_patch16_384": _row("B/16", 384, IMAGENET, 1.0, no_embed_class=True, init_values=1e-06),
    "deit3_huge_patch14_224": _row("H/14", 224, IMAGENET, 0.9, no_embed_class=True, init_values=1e-06),
    "deit3_large_patch16_224": _row("L/16", 224, IMAGENET, 0.9, no_embed_class=True, init_values=1e-06),
    "deit3_large_patch16_384": _row("L/16", 384, IMAGENET, 1.0, no_embed_class=True, init_values=1e-06),
    "deit3_medium_patch16_224": _row("M/16", 224, IMAGENET, 0.9, no_embed_class=True, init_values=1e-06),
    "deit3_small_patch16_224": _row("S/16", 224, IMAGENET, 0.9, no_embed_class=True, init_values=1e-06),
    "deit3_small_patch16_384": _row("S/16", 384, IMAGENET, 1.0, no_embed_class=True, init_values=1e-06),
    "deit_base_distilled_patch16_224": _row("B/16", 224, IMAGENET, 0.9, distilled=True),
    "deit_base_distilled_patch16_384": _row("B/16", 384, IMAGENET, 1.0, distilled=True),
    "deit_base_patch16_224": _row("B/16", 224, IMAGENET, 0.9),
    "deit_base_patch16_384": _row("B/16", 384, IMAGENET, 1.0),
    "deit_small_distilled_patch16_224": _row("S/16", 224, IMAGENET, 0.9, distilled=True),
    "deit_small_patch16_224": _row("S/16", 224, IMAGENET, 0.9),
    "deit_tiny_distilled_patch16_224": _row("Ti/16", 224, IMAGENET, 0.9, distilled=True),
    "deit_tiny_patch16_224": _row("Ti/16", 224, IMAGENET, 0.9),
    "vit_7b_patch16_dinov3": _row("7B/16", 256, IMAGENET, 1.0, **DINOV3, qkv_bias=False, mlp_layer="swiglu"),
    "vit_base_patch14_dinov2": _row("B/14", 518, IMAGENET, 1.0, init_values=1e-05, num_classes=0),
    "vit_base_patch14_reg1_tipsv2": _row("B/14", 448, RAW, 1.0, init_values=1.0, reg_tokens=1, no_embed_class=True, num_classes=0),
    "vit_base_patch14_reg4_dinov2": _row("B/14", 518, IMAGENET, 1.0, init_values=1e-05, reg_tokens=4, no_embed_class=True, num_classes=0),
    "naflexvit_base_patch16_gap": _row("B/16", 384, INCEPTION, 1.0, **NAFLEX_GAP, reg_tokens=4),
    "naflexvit_base_patch16_map": _row("B/16", 384, INCEPTION, 1.0, **NAFLEX_MAP),
    "naflexvit_base_patch16_par_gap": _row("B/16", 384, INCEPTION, 1.0, **NAFLEX_GAP, reg_tokens=4, pos_keep_aspect=True),
    "naflexvit_base_patch16_siglip": _row("B/16", 384, INCEPTION, 1.0, **NAFLEX_SIGLIP),
    "naflexvit_so150m2_patch16_reg1_gap": _row("So150m2/16", 384, INCEPTION, 1.0, **NAFLEX_GAP, reg_tokens=1, qkv_bias=False),
    "naflexvit_so150m2_patch16_reg1_map": _row("So150m2/16", 384, INCEPTION, 1.0, **NAFLEX_MAP, qkv_bias=False),
    "naflexvit_so400m_patch16_siglip": _row("So400m/16", 384, INCEPTION, 1.0, **NAFLEX_SIGLIP),
    "vit_base_patch16_224": _row("B/16", 224, INCEPTION, 0.9),
    "vit_base_patch16_224_miil": _row("B/16", 224, RAW, 0.875, qkv_bias=False, interpolation='bilinear', num_classes=11221),
    "vit_base_patch16_384": _row("B/16", 384, INCEPTION, 1.0),
    "vit_base_patch16_clip_224": _row("B/16", 224, CLIP, 0.95, **CLIP_TOWER),
    "vit_base_patch16_clip_384": _row("B/16", 384, CLIP, 1.0, **CLIP_TOWER),
    "vit_base_patch16_clip_quickgelu_224": _row("B/16", 224, CLIP, 1.0, **CLIP_TOWER, act_layer='quick_gelu', num_classes=512),
    "vit_base_patch16_dinov3": _row("B/16", 256, IMAGENET, 1.0, **DINOV3, qkv_bias=False),
    "vit_base_patch16_dinov3_qkvb": _row("B/16", 256, IMAGENET, 1.0, **DINOV3, qkv_bias="qv"),
    "vit_base_patch16_gap_224": _row("B/16", 224, INCEPTION, 0.9, num_heads=16, class_token=False, global_pool='avg', fc_norm=False),
    "vit_base_patch16_plus_240": _row("B+/16", 240, INCEPTION, 0.95, init_values=1e-05),
    "vit_base_patch16_plus_clip_240": _row("B+/16", 240, CLIP, 1.0, **CLIP_TOWER, num_classes=640),
    "vit_base_patch16_reg4_gap_256": _row("B/16", 256, INCEPTION, 0.9, class_token=False, no_embed_class=True, global_pool='avg', reg_tokens=4),
    "vit_base_patch16_rope_224": _row("B/16", 224, IMAGENET, 0.9, **ROPE, rope_xy=True),
    "vit_base_patch16_rope_ape_224": _row("B/16", 224, IMAGENET, 0.9, **ROPE_APE, rope_xy=True, no_embed_class=True),
    "vit_base_patch16_rope_mixed_224": _row("B/16", 224, IMAGENET, 0.9, **ROPE_MIXED),
    "vit_base_patch16_rope_mixed_ape_224": _row("B/16", 224, IMAGENET, 0.9, **ROPE_MIXED_APE),
    "vit_base_patch16_rope_reg1_gap_256": _row("B/16", 256, INCEPTION, 0.95, **ROPE, rope_temperature=10000.0, rope_ref_grid=16, class_token=False, reg_tokens=1, qkv_bias="qv", global_pool='avg'),
    "vit_base_patch16_siglip_224": _row("B/16", 224, INCEPTION, 0.9, **SIGLIP_MAP),
    "vit_base_patch16_siglip_256": _row("B/16", 256, INCEPTION, 0.9, **SIGLIP_MAP),
    "vit_base_patch16_siglip_384": _row("B/16", 384, INCEPTION, 0.9, **SIGLIP_MAP),
    "vit_base_patch16_siglip_512": _row("B/16", 512, INCEPTION, 0.9, **SIGLIP_MAP),
    "vit_base_patch16_siglip_gap_224": _row("B/16", 224, INCEPTION, 0.9, **SIGLIP_GAP),
    "vit_base_patch16_siglip_gap_256": _row("B/16", 256, INCEPTION, 0.9, **SIGLIP_GAP),
    "vit_base_patch16_siglip_gap_384": _row("B/16", 384, INCEPTION, 0.9, **SIGLIP_GAP),
    "vit_base_patch16_siglip_gap_512": _row("B/16", 512, INCEPTION, 0.9, **SIGLIP_GAP),
    "vit_base_patch32_224": _row("B/32", 224, INCEPTION, 0.9),
    "vit_base_patch32_384": _row("B/32", 384, INCEPTION, 1.0),
    "vit_base_patch32_clip_224": _row("B/32", 224, CLIP, 0.9, **CLIP_TOWER),
    "vit_base_patch32_clip_256": _row("B/32", 256, CLIP, 1.0, **CLIP_TOWER, num_classes=512),
    "vit_base_patch32_clip_384": _row("B/32", 384, CLIP, 1.0, **CLIP_TOWER),
    "vit_base_patch32_clip_448": _row("B/32", 448, CLIP, 1.0, **CLIP_TOWER),
    "vit_base_patch32_clip_quickgelu_224": _row("B/32", 224, CLIP, 0.9, **CLIP_TOWER, act_layer='quick_gelu', num_classes=512),
    "vit_base_patch32_plus_256": _row("B+/32", 256, INCEPTION, 0.95, init_values=1e-05),
    "vit_base_patch32_siglip_256": _row("B/32", 256, INCEPTION, 0.9, act_layer='gelu_tanh', **SIGLIP_MAP),
    "vit_base_patch8_224": _row("B/8", 224, INCEPTION, 0.9),
    "vit_betwixt_patch16_gap_256": _row("Bx/16", 256, INCEPTION, 0.95, class_token=False, global_pool='avg', qkv_bias=False, init_values=1e-06, fc_norm=False),
    "vit_betwixt_patch16_reg1_gap_256": _row("Bx/16", 256, INCEPTION, 0.95, init_values=1e-05, class_token=False, no_embed_class=True, reg_tokens=1, global_pool='avg'),
    "vit_betwixt_patch16_reg4_gap_256": _row("Bx/16", 256, INCEPTION, 0.95, init_values=1e-05, class_token=False, no_embed_class=True, reg_tokens=4, global_pool='avg'),
    "vit_betwixt_patch16_reg4_gap_384": _row("Bx/16", 384, INCEPTION, 1.0, init_values=1e-05, class_token=False, no_embed_class=True, reg_tokens=4, global_pool='avg'),
    "vit_betwixt_patch16_rope_reg4_gap_256": _row("Bx/16", 256, CLIP, 0.95, **ROPE, rope_temperature=10000.0, rope_ref_grid=16, class_token=False, reg_tokens=4, qkv_bias="qv", global_pool='avg'),
    "vit_betwixt_patch32_clip_224": _row("Bx/32", 224, CLIP, 0.9, **CLIP_TOWER, num_classes=512),
    "vit_giant_patch14_224": _row("g/14", 224, INCEPTION, 0.9),
    "vit_giant_patch14_clip_224": _row("g/14", 224, CLIP, 1.0, **CLIP_TOWER, num_classes=1024),
    "vit_giant_patch16_gap_224": _row("g/16", 224, IMAGENET, 0.9, class_token=False, global_pool='avg', fc_norm=False, num_classes=0),
    "vit_giantopt_patch16_siglip_256": _row("Gopt/16", 256, INCEPTION, 0.9, act_layer='gelu_tanh', **SIGLIP_MAP),
    "vit_giantopt_patch16_siglip_384": _row("Gopt/16", 384, INCEPTION, 0.9, act_layer='gelu_tanh', **SIGLIP_MAP),
    "vit_gigantic_patch14_224": _row("G/14", 224, INCEPTION, 0.9),
    "vit_gigantic_patch14_clip_224": _row("G/14", 224, CLIP, 1.0, **CLIP_TOWER, num_classes=1280),
    "vit_gigantic_patch14_clip_378": _row("G/14", 378, CLIP, 1.0, **CLIP_TOWER, num_classes=1280),
    "vit_gigantic_patch14_clip_quickgelu_224": _row("G/14", 224, CLIP, 1.0, **CLIP_TOWER, act_layer='quick_gelu', num_classes=1280),
    "vit_huge_patch14_224": _row("H/14", 224, INCEPTION, 0.9, num_classes=0),
    "vit_huge_patch14_clip_224": _row("H/14", 224, CLIP, 1.0, **CLIP_TOWER),
    "vit_huge_patch14_clip_336": _row("H/14", 336, CLIP, 1.0, **CLIP_TOWER),
    "vit_huge_patch14_clip_378": _row("H/14", 378, CLIP, 1.0, **CLIP_TOWER, num_classes=1024),
    "vit_huge_patch14_clip_quickgelu_224": _row("H/14", 224, CLIP, 1.0, **CLIP_TOWER, act_layer='quick_gelu', num_classes=1024),
    "vit_huge_patch14_clip_quickgelu_378": _row("H/14", 378, CLIP, 1.0, **CLIP_TOWER, act_layer='quick_gelu', num_classes=1024),
    "vit_huge_patch14_gap_224": _row("H/14", 224, IMAGENET, 0.9, class_token=False, global_pool='avg', fc_norm=False, num_classes=0),
    "vit_huge_patch16_gap_448": _row("H/16", 448, IMAGENET, 1.0, class_token=False, global_pool='avg', fc_norm=False, num_classes=0),
    "vit_huge_plus_patch16_dinov3": _row("H+/16", 256, IMAGENET, 1.0, **DINOV3, qkv_bias=False, mlp_layer="swiglu"),
    "vit_huge_plus_patch16_dinov3_qkvb": _row("H+/16", 256, IMAGENET, 1.0, **DINOV3, qkv_bias="qv", mlp_layer="swiglu"),
    "vit_large_patch14_224": _row("L/14", 224, INCEPTION, 0.9),
    "vit_large_patch14_clip_224": _row("L/14", 224, INCEPTION, 1.0, **CLIP_TOWER),
    "vit_large_patch14_clip_336": _row("L/14", 336, INCEPTION, 1.0, **CLIP_TOWER),
    "vit_large_patch14_clip_quickgelu_224": _row("L/14", 224, CLIP, 1.0, **CLIP_TOWER, act_layer='quick_gelu', num_classes=768),
    "vit_large_patch14_clip_quickgelu_336": _row("L/14", 336, CLIP, 1.0, **CLIP_TOWER, act_layer='quick_gelu', num_classes=768),
    "vit_large_patch14_dinov2": _row("L/14", 518, IMAGENET, 1.0, init_values=1e-05, num_classes=0),
    "vit_large_patch14_reg1_tipsv2": _row("L/14", 448, RAW, 1.0, init_values=1.0, reg_tokens=1, no_embed_class=True, num_classes=0),
    "vit_large_patch14_reg4_dinov2": _row("L/14", 518, IMAGENET, 1.0, init_values=1e-05, reg_tokens=4, no_embed_class=True, num_classes=0),
    "vit_large_patch16_224": _row("L/16", 224, INCEPTION, 0.9),
    "vit_large_patch16_384": _row("L/16", 384, INCEPTION, 1.0),
    "vit_large_patch16_dinov3": _row("L/16", 256, IMAGENET, 1.0, **DINOV3, qkv_bias=False),
    "vit_large_patch16_dinov3_qkvb": _row("L/16", 256, IMAGENET, 1.0, **DINOV3, qkv_bias="qv"),
    "vit_large_patch16_rope_224": _row("L/16", 224, IMAGENET, 0.9, **ROPE, rope_xy=True),
    "vit_large_patch16_rope_ape_224": _row("L/16", 224, IMAGENET, 0.9, **ROPE_APE, rope_xy=True, no_embed_class=True),
    "vit_large_patch16_rope_mixed_224": _row("L/16", 224, IMAGENET, 0.9, **ROPE_MIXED),
    "vit_large_patch16_rope_mixed_ape_224": _row("L/16", 224, IMAGENET, 0.9, **ROPE_MIXED_APE),
    "vit_large_patch16_siglip_256": _row("L/16", 256, INCEPTION, 0.9, **SIGLIP_MAP),
    "vit_large_patch16_siglip_384": _row("L/16", 384, INCEPTION, 0.9, **SIGLIP_MAP),
    "vit_large_patch16_siglip_512": _row("L/16", 512, INCEPTION, 0.9, act_layer='gelu_tanh', **SIGLIP_MAP),
    "vit_large_patch16_siglip_gap_256": _row("L/16", 256, INCEPTION, 0.9, **SIGLIP_GAP),
    "vit_large_patch16_siglip_gap_384": _row("L/16", 384, INCEPTION, 0.9, **SIGLIP_GAP),
    "vit_large_patch32_224": _row("L/32", 224, INCEPTION, 0.9, num_classes=0),
    "vit_large_patch32_384": _row("L/32", 384, INCEPTION, 1.0),
    "vit_little_patch16_reg1_gap_256": _row("Little/16", 256, INCEPTION, 0.95, init_values=1e-05, class_token=False, no_embed_class=True, reg_tokens=1, global_pool='avg'),
    "vit_little_patch16_reg4_gap_256": _row("Little/16", 256, INCEPTION, 0.95, init_values=1e-05, class_token=False, no_embed_class=True, reg_tokens=4, global_pool='avg'),
    "vit_medium_patch16_clip_224": _row("M/16", 224, CLIP, 0.9, **CLIP_TOWER, num_classes=512),
    "vit_medium_patch16_gap_240": _row("M/16", 240, INCEPTION, 0.95, class_token=False, global_pool='avg', qkv_bias=False, init_values=1e-06, fc_norm=False, num_classes=11821),
    "vit_medium_patch16_gap_256": _row("M/16", 256, INCEPTION, 0.95, class_token=False, global_pool='avg', qkv_bias=False, init_values=1e-06, fc_norm=False),
    "vit_medium_patch16_gap_384": _row("M/16", 384, INCEPTION, 0.95, class_token=False, global_pool='avg', qkv_bias=False, init_values=1e-06, fc_norm=False),
    "vit_medium_patch16_reg1_gap_256": _row("M/16", 256, INCEPTION, 0.95, init_values=1e-05, class_token=False, no_embed_class=True, reg_tokens=1, global_pool='avg'),
    "vit_medium_patch16_reg4_gap_256": _row("M/16", 256, INCEPTION, 0.95, init_values=1e-05, class_token=False, no_embed_class=True, reg_tokens=4, global_pool='avg'),
    "vit_medium_patch16_rope_reg1_gap_256": _row("M/16", 256, INCEPTION, 0.95, **ROPE, rope_temperature=10000.0, rope_ref_grid=16, class_token=False, reg_tokens=1, qkv_bias="qv", global_pool='avg'),
    "vit_medium_patch32_clip_224": _row("M/32", 224, CLIP, 0.9, **CLIP_TOWER, num_classes=512),
    "vit_mediumd_patch16_reg4_gap_256": _row("Md/16", 256, INCEPTION, 0.95, init_values=1e-05, class_token=False, no_embed_class=True, reg_tokens=4, global_pool='avg'),
    "vit_mediumd_patch16_reg4_gap_384": _row("Md/16", 384, INCEPTION, 1.0, init_values=1e-05, class_token=False, no_embed_class=True, reg_tokens=4, global_pool='avg'),
    "vit_mediumd_patch16_rope_reg1_gap_256": _row("Md/16", 256, INCEPTION, 0.95, **ROPE, rope_temperature=10000.0, rope_ref_grid=16, class_token=False, reg_tokens=1, qkv_bias=False, global_pool='avg'),
    "vit_small_patch14_dinov2": _row("S/14", 518, IMAGENET, 1.0, init_values=1e-05, num_classes=0),
    "vit_small_patch14_reg4_dinov2": _row("S/14", 518, IMAGENET, 1.0, init_values=1e-05, reg_tokens=4, no_embed_class=True, num_classes=0),
    "vit_small_patch16_224": _row("S/16", 224, INCEPTION, 0.9),
    "vit_small_patch16_36x1_224": _row("S36/16", 224, INCEPTION, 0.9, init_values=1e-05),
    "vit_small_patch16_384": _row("S/16", 384, INCEPTION, 1.0),
    "vit_small_patch16_dinov3": _row("S/16", 256, IMAGENET, 1.0, **DINOV3, qkv_bias=False),
    "vit_small_patch16_dinov3_qkvb": _row("S/16", 256, IMAGENET, 1.0, **DINOV3, qkv_bias="qv"),
    "vit_small_patch16_rope_224": _row("S/16", 224, IMAGENET, 0.9, **ROPE, rope_xy=True),
    "vit_small_patch16_rope_ape_224": _row("S/16", 224, IMAGENET, 0.9, **ROPE_APE, rope_xy=True, no_embed_class=True),
    "vit_small_patch16_rope_mixed_224": _row("S/16", 224, IMAGENET, 0.9, **ROPE_MIXED),
    "vit_small_patch16_rope_mixed_ape_224": _row("S/16", 224, IMAGENET, 0.9, **ROPE_MIXED_APE),
    "vit_small_patch32_224": _row("S/32", 224, INCEPTION, 0.9),
    "vit_small_patch32_384": _row("S/32", 384, INCEPTION, 1.0),
    "vit_small_patch8_224": _row("S/8", 224, IMAGENET, 0.9, num_classes=0),
    "vit_small_plus_patch16_dinov3": _row("S/16", 256, IMAGENET, 1.0, **DINOV3, qkv_bias=False, mlp_layer="swiglu"),
    "vit_small_plus_patch16_dinov3_qkvb": _row("S/16", 256, IMAGENET, 1.0, **DINOV3, qkv_bias="qv", mlp_layer="swiglu"),
    "vit_so150m2_patch16_reg1_gap_256": _row("So150m2/16", 256, INCEPTION, 1.0, init_values=1e-05, qkv_bias=False, class_token=False, reg_tokens=1, global_pool='avg'),
    "vit_so150m2_patch16_reg1_gap_384": _row("So150m2/16", 384, INCEPTION, 1.0, init_values=1e-05, qkv_bias=False, class_token=False, reg_tokens=1, global_pool='avg'),
    "vit_so150m2_patch16_reg1_gap_448": _row("So150m2/16", 448, INCEPTION, 1.0, init_values=1e-05, qkv_bias=False, class_token=False, reg_tokens=1, global_pool='avg'),
    "vit_so150m_patch16_reg4_gap_256": _row("So150m/16", 256, INCEPTION, 0.95, class_token=False, reg_tokens=4, global_pool='avg', fc_norm=False),
    "vit_so150m_patch16_reg4_gap_384": _row("So150m/16", 384, INCEPTION, 1.0, class_token=False, reg_tokens=4, global_pool='avg', fc_norm=False),
    "vit_so400m_patch14_reg1_tipsv2": _row("So400mT/14", 448, RAW, 1.0, init_values=1.0, reg_tokens=1, no_embed_class=True, num_classes=0),
    "vit_so400m_patch14_siglip_224": _row("So400m/14", 224, INCEPTION, 0.9, **SIGLIP_MAP),
    "vit_so400m_patch14_siglip_378": _row("So400m/14", 378, INCEPTION, 0.9, **SIGLIP_MAP),
    "vit_so400m_patch14_siglip_384": _row("So400m/14", 384, INCEPTION, 0.9, **SIGLIP_MAP),
    "vit_so400m_patch14_siglip_gap_224": _row("So400m/14", 224, INCEPTION, 0.9, **SIGLIP_GAP),
    "vit_so400m_patch14_siglip_gap_378": _row("So400m/14", 378, INCEPTION, 0.9, **SIGLIP_GAP),
    "vit_so400m_patch14_siglip_gap_384": _row("So400m/14", 384, INCEPTION, 1.0, **SIGLIP_GAP),
    "vit_so400m_patch14_siglip_gap_448": _row("So400m/14", 448, INCEPTION, 1.0, **SIGLIP_GAP),
    "vit_so400m_patch14_siglip_gap_896": _row("So400m/14", 896, INCEPTION, 1.0, **SIGLIP_GAP),
    "vit_so400m_patch16_siglip_256": _row("So400m/16", 256, INCEPTION, 0.9, act_layer='gelu_tanh', **SIGLIP_MAP),
    "vit_so400m_patch16_siglip_384": _row("So400m/16", 384, INCEPTION, 0.9, act_layer='gelu_tanh', **SIGLIP_MAP),
    "vit_so400m_patch16_siglip_512": _row("So400m/16", 512, INCEPTION, 0.9, act_layer='gelu_tanh', **SIGLIP_MAP),
    "vit_tiny_patch16_224": _row("Ti/16", 224, INCEPTION, 0.9),
    "vit_tiny_patch16_384": _row("Ti/16", 384, INCEPTION, 1.0),
    "vit_tiny_patch16_dinov3_qkvb": _row("Ti/16", 256, IMAGENET, 1.0, **DINOV3, qkv_bias="qv"),
    "vit_wee_patch16_reg1_gap_256": _row("Wee/16", 256, INCEPTION, 0.95, init_values=1e-05, class_token=False, no_embed_class=True, reg_tokens=1, global_pool='avg'),
    "vit_xsmall_patch16_clip_224": _row("Xs/16", 224, CLIP, 0.9, **CLIP_TOWER, num_classes=512),
}
