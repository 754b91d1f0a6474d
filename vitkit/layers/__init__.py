"""Shared layers: the attention core and the blocks every vitkit model is built from."""

from .attention import ATTN_BACKENDS, BACKENDS, Attention, AttnBackend
from .attention_pool import AttentionPool
from .block import Block, DecoderBlock, PostNormBlock, PostNormDecoderBlock, ResPostNormBlock
from .cross_attention import CrossAttention
from .drop import DropPath, drop_path_rates
from .kv_cache import KVCache, MemoryKV
from .layer_scale import LayerScale
from .mlp import ACTIVATIONS, Mlp, QuickGELU
from .patch_embed import PatchEmbed
from .pos_embed import apply_rope, resample_abs_pos_embed, sincos_2d, sinusoidal_1d

__all__ = [
    "ACTIVATIONS", "ATTN_BACKENDS", "Attention", "AttentionPool", "BACKENDS", "AttnBackend", "Block", "CrossAttention",
    "DecoderBlock", "DropPath", "KVCache", "LayerScale", "MemoryKV", "Mlp", "PatchEmbed", "PostNormBlock",
    "PostNormDecoderBlock", "QuickGELU", "ResPostNormBlock", "apply_rope", "drop_path_rates", "resample_abs_pos_embed",
    "sincos_2d", "sinusoidal_1d",
]
