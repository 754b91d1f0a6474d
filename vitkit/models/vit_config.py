"""The ViT's config: every field that defines a ViT (``vit_presets`` holds rows of overrides to it)."""

from dataclasses import dataclass
from typing import Literal

from vitkit.errors import UsageError

from ..layers import AttnBackend
from ..layers.attention import check_backend
from ..layers.mlp import ACTIVATIONS
from ..layers.token_merging import TokenMerging, merge_schedule
from .config import DataConfig, pair


def check_token_merging(r: TokenMerging, depth: int, rope: str) -> None:
    """A valid merging value (``merge_schedule`` checks its form), and absolute positions to merge under."""
    merge_schedule(r, depth)
    if r and rope:
        raise UsageError(f"token_merging needs a ViT with absolute positions: RoPE (rope={rope!r} here) rotates q "
                         "and k by each token's grid position, which a merged token no longer has")


POOLS = ("token", "avg", "max", "avgmax", "map", "")  # "": no pooling, the head sees every token; "map": attention


@dataclass
class ViTConfig(DataConfig):
    """Everything that defines a ViT; presets below are rows of overrides to it."""

    img_size: int | tuple[int, int] = 224
    patch_size: int = 16
    in_chans: int = 3
    num_classes: int = 1000
    embed_dim: int = 768
    depth: int = 12
    num_heads: int = 12
    num_kv_heads: int | None = None  # < num_heads: grouped-query attention
    mlp_ratio: float = 4.0
    qkv_bias: bool | Literal["qv"] = True  # "qv": q and v biases only (DINOv3's _qkvb weights)
    class_token: bool = True
    reg_tokens: int = 0  # register tokens (Darcet et al., 2024), after the class (and distillation) token
    distilled: bool = False  # DeiT's distillation token after the class token, with its own head (head_dist)
    global_pool: Literal["token", "avg", "max", "avgmax", "map", ""] = "token"  # map: attention pool (SigLIP)
    fc_norm: bool | None = None  # norm after pooling instead of before; None = only for avg pooling
    map_prefix: bool = True  # map: the attention pool reads the prefix tokens too (timm's ViT); False: patches alone
    no_embed_class: bool = False  # positions cover patches only (DeiT III, big_vision)
    pos_embed: Literal["learn", "sincos", "none"] = "learn"  # none: positions from RoPE alone (DINOv3)
    # learned positions kept on a square grid of this many patches a side instead of img_size's, and resampled to
    # each input's grid (so it needs dynamic_img_size): timm's NaFlexViT keeps 16 x 16 for its 384-px inputs
    pos_grid: int | None = None
    pos_interp: Literal["bicubic", "bilinear"] = "bicubic"  # how learned positions resample to another grid
    # resampled antialiased (timm's, PIL's cubic); False: torch's plain interpolation (transformers' DINOv2 and DPT)
    pos_antialias: bool = True
    # resampled to the square of the input grid's longer side, then its rows and columns taken (NaFlexViT's
    # pos_embed_ar_preserving): a wide image's top row gets a square image's top-row positions
    pos_keep_aspect: bool = False
    # rotary positions on q and k (patches only): DINOv3's, axial (Heo et al., 2024; EVA-02), or mixed (learned
    # frequencies per block and head, NAVER's RoPE-Mixed)
    rope: Literal["", "dinov3", "axial", "mixed"] = ""
    rope_temperature: float = 100.0
    rope_xy: bool = False  # axial: the column's frequencies first (timm's grid_indexing "xy")
    rope_ref_grid: int | None = None  # axial: patch indices rescaled to this grid (EVA's rule for other sizes)
    mlp_layer: Literal["mlp", "swiglu"] = "mlp"  # swiglu: SiLU-gated MLP (DINOv3 S+/H+/7B, EVA-02)
    mlp_norm: bool = False  # a LayerNorm on the SwiGLU's hidden units (EVA-02 B/L's sub-LN)
    attn_norm: bool = False  # a LayerNorm on the heads' output before the projection (EVA-02 CLIP's sub-LN)
    pre_norm: bool = False  # LayerNorm before the blocks, and a patch conv without bias (CLIP)
    res_post_norm: bool = False  # blocks add norm(attn(x)) and norm(mlp(x)) to x (EVA-02-E)
    act_layer: Literal["gelu", "gelu_tanh", "quick_gelu"] = "gelu"  # the MLPs' (quick_gelu: OpenAI's CLIP)
    init_values: float | None = None  # LayerScale
    norm_eps: float = 1e-6
    drop_rate: float = 0.0  # before the head
    pos_drop_rate: float = 0.0
    proj_drop_rate: float = 0.0
    attn_drop_rate: float = 0.0
    drop_path_rate: float = 0.0
    attn_backend: AttnBackend = "auto"
    dynamic_img_size: bool = False  # any H, W: positions resampled to each input's patch grid (timm's flag)
    token_merging: TokenMerging = 0  # ToMe: token pairs merged per block (int, (r, inflection) or per-block list)

    def __post_init__(self) -> None:
        check_backend(self.attn_backend)
        for field, allowed in (("global_pool", POOLS), ("act_layer", tuple(ACTIVATIONS)),
                               ("mlp_layer", ("mlp", "swiglu")), ("pos_embed", ("learn", "sincos", "none")),
                               ("rope", ("", "dinov3", "axial", "mixed"))):
            if getattr(self, field) not in allowed:
                raise UsageError(f"{field} must be one of {allowed}, got {getattr(self, field)!r}")
        if self.global_pool == "token" and not self.class_token:
            raise UsageError("global_pool='token' needs class_token=True")
        if self.distilled and (not self.class_token or self.global_pool != "token"):
            raise UsageError("distilled=True (DeiT's distillation token) needs class_token=True and "
                             f"global_pool='token', got class_token={self.class_token}, "
                             f"global_pool={self.global_pool!r}")
        if self.mlp_norm and self.mlp_layer != "swiglu":
            raise UsageError("mlp_norm=True (a norm on the hidden units) needs mlp_layer='swiglu'")
        check_token_merging(self.token_merging, self.depth, self.rope)
        if min(pair(self.img_size)) < self.patch_size:
            raise UsageError(f"img_size {pair(self.img_size)} is smaller than patch_size {self.patch_size}")
        if self.pos_grid is not None and (self.pos_embed != "learn" or not self.dynamic_img_size):
            raise UsageError(f"pos_grid={self.pos_grid} keeps learned positions apart from img_size's grid and "
                             "resamples them to each input: it needs pos_embed='learn' and dynamic_img_size=True, "
                             f"got pos_embed={self.pos_embed!r}, dynamic_img_size={self.dynamic_img_size}")

    @property
    def grid_size(self) -> tuple[int, int]:
        """Patches per side; like timm's conv stem, a remainder of < patch_size pixels is not seen."""
        h, w = pair(self.img_size)
        return h // self.patch_size, w // self.patch_size

    @property
    def pos_grid_size(self) -> tuple[int, int]:
        """The grid the positions are stored for: ``pos_grid`` a side, else img_size's."""
        return (self.pos_grid, self.pos_grid) if self.pos_grid is not None else self.grid_size
