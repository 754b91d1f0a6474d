"""The one attention core of vitkit: softmax(q·kᵀ/√d + bias, masked) · v, and nowhere else.

ViT, Swin and the text encoder-decoder all use :class:`Attention`; they differ only in what they pass it: an
additive ``bias`` (Swin's relative positions, ALiBi), a boolean ``attn_mask`` (Swin's shifted-window regions,
sliding windows), a ``key_padding_mask``, ``is_causal``, a ``memory`` for cross-attention, ``rope`` tables, a cache.

Shape legend: B batch; G groups (Swin windows per image; 1 for ViT and text): ``x: (B, G, N, C)`` is folded into
``(B·G, H, N, D)``, q, k and v staying views of the fused projection; N query tokens, M key/value tokens; C model
width; H query heads, Hkv key/value heads (GQA/MQA when < H); D head dim.

Backends (a config field stored on the module, never an environment variable):
    ``auto``  the default: on CPU ``sdpa`` or ``math``, whichever the first call of each kind measured faster here
              (``autotune``; a traced graph follows ``kernels.static_backend``); ``sdpa`` elsewhere.
    ``sdpa``  always F.scaled_dot_product_attention. With no float mask it can reach FlashAttention on GPU; a float
              mask (bias, or merged masks) rules flash out, and the memory-efficient and cuDNN kernels remain.
    ``math``  explicit softmax(q·kᵀ/√d + mask)·v: the reference tests compare against, the only path that returns
              the probabilities. Its matmuls need q, k, v head-major: three copies the kernel does not make.
    ``flex``  torch.nn.attention.flex_attention, compiled; the bias becomes a ``score_mod`` and the boolean
              masks a block mask that skips fully masked blocks. PyTorch has no flex backward on CPU, so a CPU
              forward that needs gradients falls back to ``sdpa`` (logged once), as does a CPU without AVX2.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import UsageError
from . import autotune
from .kernels import _compiled_flex, _warn_flex_fallback, _warn_flex_unsupported, flex_runs_on_cpu
from .masks import causal, fold, merge
from .pos_embed import apply_rope

AttnBackend = Literal["auto", "sdpa", "math", "flex"]


def check_backend(backend: str) -> str:
    if backend not in ATTN_BACKENDS:
        raise UsageError(f"attn_backend must be one of {ATTN_BACKENDS}, got {backend!r}")
    return backend


# -- backends: one function each, (module, q, k, v, call) -> (output (B·G, H, N, D), probabilities or None) -----

@dataclass
class _Call:
    """What a backend needs besides q, k and v: the masks as given and as merged (``masks.merge``), sizes."""

    bias: Tensor | None
    attn_mask: Tensor | None
    key_padding_mask: Tensor | None
    is_causal: bool
    mask: Tensor | None
    keep: Tensor | None
    B: int
    G: int
    N: int
    M: int
    dropout_p: float
    scale: float


def _sdpa(q: Tensor, k: Tensor, v: Tensor, c: _Call) -> tuple[Tensor, None]:
    return sdpa_attention(q, k, v, c.mask, c.is_causal, c.B, c.G, c.dropout_p, c.scale), None


def _explicit(q: Tensor, k: Tensor, v: Tensor, c: _Call) -> tuple[Tensor, Tensor]:
    return math_attention(q, k, v, c.mask, c.keep, c.is_causal, c.B, c.scale, c.dropout_p)


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, B: int, G: int,
                   dropout_p: float, scale: float) -> Tensor:
    """The fused kernel; ``mask`` is merged (``masks.merge``), broadcastable to (B, G, H, N, M)."""
    N, M = q.shape[-2], k.shape[-2]
    use_causal_flag = is_causal and mask is None and N == M
    if is_causal and not use_causal_flag and mask is None and N != 1:
        mask = causal(N, M, q.device)
    if mask is not None:
        mask = fold(mask, B, G, q.shape[1], N, M)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=use_causal_flag,
                                          scale=scale, enable_gqa=k.shape[1] != q.shape[1])


def math_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, keep: Tensor | None, is_causal: bool,
                   B: int, scale: float, dropout_p: float) -> tuple[Tensor, Tensor]:
    """The explicit path: (output, probabilities). mask: merged, broadcastable to (B, G, H, N, M) (or (N, M)),
    applied with the group axis apart, so a per-window mask broadcasts over the batch instead of being copied B
    times; ``keep`` is its boolean part. Queries with no key to attend get zeros (as sdpa gives), with finite
    gradients. ``dropout_p`` > 0 only in training (the caller passes 0 in eval)."""
    if is_causal and mask is None:
        mask = causal(q.shape[-2], k.shape[-2], q.device)
    dead: Tensor | None = None  # queries whose every key is masked; always looked for under a compiler
    if keep is not None:
        compiling = False if torch.jit.is_scripting() else torch.compiler.is_compiling()
        if compiling or not bool(keep.any(dim=-1).all()):
            dead = ~keep.any(dim=-1, keepdim=True)  # (B|1, G|1, H|1, N, 1)
    if k.shape[1] != q.shape[1]:  # GQA: each kv head serves H / Hkv query heads
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    # q and k head-major (a copy each), the scale on q (N·D values, not the scores' N·M; a compiler folds it into
    # the copy, where a baddbmm's alpha would have it write out the unread input at the scores' size)
    BG, H, N, D = q.shape
    scores = torch.bmm(q.reshape(BG * H, N, D) * scale, k.reshape(BG * H, -1, D).transpose(1, 2)).view(BG, H, N, -1)
    if mask is not None:
        s = scores.view([B, -1] + list(scores.shape[1:]))  # (B, G, H, N, M)
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask  # float if a bias
        scores = (s if dead is None else s.masked_fill(dead, 0.0)).flatten(0, 1)
    # bf16/fp16 logits go into softmax as they are (it accumulates in float32 inside) and the probabilities
    # come out in that dtype: autograd then keeps one half-precision (B·G, H, N, M) tensor, not a float32 one
    attn = scores.to(q.dtype).softmax(dim=-1)
    if dead is not None:
        attn = attn.view([B, -1] + list(attn.shape[1:])).masked_fill(dead, 0.0).flatten(0, 1)
    return F.dropout(attn, dropout_p, training=dropout_p > 0) @ v, attn


def _flex(q: Tensor, k: Tensor, v: Tensor, c: _Call) -> tuple[Tensor, None]:
    """The bias as a ``score_mod``, the boolean masks as a block mask that skips fully masked blocks."""
    from torch.nn.attention.flex_attention import create_block_mask

    if c.dropout_p:
        raise UsageError("attn_backend='flex' does not support attention dropout; use 'sdpa'")
    bias, attn_mask, key_padding_mask, B, G = c.bias, c.attn_mask, c.key_padding_mask, c.B, c.G
    H, N, M = q.shape[1], c.N, c.M
    score_mod = None
    if bias is not None:
        fb = fold(bias, B, G, H, N, M)
        bb, bh, bq = fb.shape[0] > 1, fb.shape[1] > 1, fb.shape[2] > 1  # a bias may be one row for all queries

        def score_mod(score, b, h, qi, ki):
            return score + fb[b if bb else 0, h if bh else 0, qi if bq else 0, ki]

    conds = []
    if attn_mask is not None:
        fm = fold(attn_mask, B, G, H, N, M)
        mb, mh = fm.shape[0] > 1, fm.shape[1] > 1
        conds.append(lambda b, h, qi, ki: fm[b if mb else 0, h if mh else 0, qi, ki])
    if key_padding_mask is not None:
        keep_k = fold(~key_padding_mask[:, None, None, None, :], B, G, H, N, M)[:, 0, 0]  # (B·G, M)
        conds.append(lambda b, h, qi, ki: keep_k[b, ki])
    if c.is_causal:
        conds.append(lambda b, h, qi, ki: qi + (M - N) >= ki)
    block_mask = None
    if conds:
        def mask_mod(b, h, qi, ki):
            ok = conds[0](b, h, qi, ki)
            for cond in conds[1:]:
                ok = ok & cond(b, h, qi, ki)
            return ok

        per_b = key_padding_mask is not None or (attn_mask is not None and mb)
        per_h = attn_mask is not None and mh
        block_mask = create_block_mask(mask_mod, q.shape[0] if per_b else None, q.shape[1] if per_h else None,
                                       N, M, device=q.device)
    return _compiled_flex()(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=c.scale,
                            enable_gqa=k.shape[1] != q.shape[1]), None


BACKENDS = {"sdpa": _sdpa, "math": _explicit, "flex": _flex}  # a new backend is one entry here
ATTN_BACKENDS: tuple[str, ...] = ("auto", *BACKENDS)


def attention(q: Tensor, k: Tensor, v: Tensor, lead: list[int], bias: Tensor | None, attn_mask: Tensor | None,
              key_padding_mask: Tensor | None, is_causal: bool, backend: str, scale: float, dropout_p: float,
              return_attn: bool) -> tuple[Tensor, Tensor | None]:
    """softmax(q·kᵀ·scale + bias, masked)·v on ``backend`` (or the one that runs in its place, see the module
    docstring): q (B·G, H, N, D), k and v (B·G, Hkv, M, D) -> (B·G, H, N, D), and the probabilities when asked;
    ``lead`` is the input's shape before N and C. torch.fx keeps it whole (its choices read device, dtype, values)."""
    B, G = lead[0], 1
    for g in lead[1:]:
        G *= g
    N, M = q.shape[-2], k.shape[-2]
    mask, keep = merge(bias, attn_mask, key_padding_mask, is_causal, B, N, M, q.device)
    if not torch.jit.is_scripting():
        call = _Call(bias, attn_mask, key_padding_mask, is_causal, mask, keep, B, G, N, M, dropout_p, scale)
        learned_bias = bias is not None and bias.requires_grad and torch.is_grad_enabled()
        return BACKENDS[_backend_for(backend, q, k, v, call, return_attn, learned_bias)](q, k, v, call)
    # TorchScript: the same two paths without the Python table (auto and flex, torch.compile's: sdpa here)
    if return_attn or backend == "math":
        o, p = math_attention(q, k, v, mask, keep, is_causal, B, scale, dropout_p)
        return o, p
    return sdpa_attention(q, k, v, mask, is_causal, B, G, dropout_p, scale), None


torch.fx.wrap("attention"), torch.fx.wrap("apply_rope")  # apply_rope: its layout follows the tables' width


def _backend_for(backend: str, q: Tensor, k: Tensor, v: Tensor, call: _Call, return_attn: bool,
                 learned_bias: bool) -> str:
    """The backend that runs: the module's, ``auto`` resolved, or ``sdpa`` where flex cannot (module docstring)."""
    if return_attn:
        return "math"
    cpu, grad = q.device.type == "cpu", torch.is_grad_enabled() and q.requires_grad
    if backend == "flex" and cpu and (grad or not flex_runs_on_cpu()):
        (_warn_flex_fallback if grad else _warn_flex_unsupported)()  # each logged once
        return "sdpa"
    if backend == "auto":
        return autotune.auto_backend(q, k, v, call, learned_bias, BACKENDS) if cpu else "sdpa"
    return backend


class Attention(nn.Module):
    """Multi-head self-attention (Vaswani et al., 2017) with GQA/MQA, RoPE, a KV cache and three backends.

    Subclasses change where q, k and v come from (:class:`CrossAttention`) or what bias is added (Swin's
    window attention); the attention itself is :meth:`attend`, here and nowhere else."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        qkv_bias: bool | str = True,  # "qv": q and v only (timm's q_bias, v_bias: EVA, DINOv3, Swin V2)
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        backend: AttnBackend = "auto",
        norm_layer: Callable[[int], nn.Module] | None = None,  # on the heads' output before W_O (EVA-02's sub-LN)
    ) -> None:
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        if dim % num_heads or num_heads % num_kv_heads:
            raise UsageError(f"dim ({dim}) must be divisible by num_heads ({num_heads}), and num_heads a multiple "
                             f"of num_kv_heads ({num_kv_heads})")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, dim // num_heads
        self.scale = self.head_dim**-0.5
        self.backend = check_backend(backend)
        self.in_projections(dim, qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)  # its rate goes to the backend, in training only
        self.out_norm = norm_layer(num_heads * self.head_dim) if norm_layer is not None else nn.Identity()
        self.proj = nn.Linear(num_heads * self.head_dim, dim)  # W_O
        self.proj_drop = nn.Dropout(proj_drop)

    def in_projections(self, dim: int, qkv_bias: bool | str) -> None:
        """One fused projection; with Hkv == H its layout is timm's [q | k | v]. With ``qkv_bias="qv"`` the keys
        have no bias: under RoPE or cosine attention a key bias would not cancel in softmax."""
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        self.qkv = nn.Linear(dim, (H + 2 * Hkv) * D, bias=qkv_bias is True)
        self.q_bias = nn.Parameter(torch.zeros(H * D)) if qkv_bias == "qv" else None
        self.v_bias = nn.Parameter(torch.zeros(Hkv * D)) if qkv_bias == "qv" else None

    def forward(self, x: Tensor, bias: Tensor | None = None, attn_mask: Tensor | None = None,
                key_padding_mask: Tensor | None = None, is_causal: bool = False,
                rope: tuple[Tensor, Tensor] | None = None, cache: Any = None) -> Tensor:
        """Attend from x (B, [G,] N, C) to itself.

        bias: float, broadcastable to (B, H, N, M) (or (B, G, H, N, M)), added to the scaled scores.
        attn_mask: bool, broadcastable likewise; True = may attend.
        key_padding_mask: bool (B, M); True marks padding keys, which are never attended.
        is_causal: query i attends keys j <= i.
        rope: (cos, sin) tables for the query positions, (N, D/2) each, applied to q and k.
        cache: a :class:`KVCache`; this step's keys are written into it and the queries attend to every key
            it holds (causality and the sliding window come from its positions); eager or compiled, not TorchScript.
        """
        q, k, v = self.project(x, rope)
        if not torch.jit.is_scripting():
            if cache is not None:
                k, v, keep = cache.append(k, v)  # (B, Hkv, S, D) each, keep (N, S)
                attn_mask = keep if attn_mask is None else attn_mask & keep
                is_causal = False
        return self.attend(q, k, v, x.shape[:-2], bias, attn_mask, key_padding_mask, is_causal, False)[0]

    def forward_with_attn(self, x: Tensor, bias: Tensor | None = None, attn_mask: Tensor | None = None,
                          key_padding_mask: Tensor | None = None, is_causal: bool = False,
                          rope: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """:meth:`forward` on the `math` path, and the attention probabilities (B·G, H, N, M)."""
        q, k, v = self.project(x, rope)
        o, attn = self.attend(q, k, v, x.shape[:-2], bias, attn_mask, key_padding_mask, is_causal, True)
        assert attn is not None
        return o, attn

    def project(self, x: Tensor, rope: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, [G,] N, C) -> q (B·G, H, N, D), k and v (B·G, Hkv, N, D): views of the fused projection."""
        N, C, H, Hkv, D = x.shape[-2], x.shape[-1], self.num_heads, self.num_kv_heads, self.head_dim
        qb, vb, x = self.q_bias, self.v_bias, x.reshape(-1, N, C)
        qkv = self.qkv(x)  # all biases or none; or biases for q and v alone, added (an adapted qkv keeps its forward)
        if qb is not None and vb is not None:
            qkv = qkv + torch.cat([qb, torch.zeros_like(vb), vb])
        q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)  # (B·G, N, ·)
        q = q.unflatten(-1, (H, D)).transpose(1, 2)  # (B·G, H, N, D), a view
        k = k.unflatten(-1, (Hkv, D)).transpose(1, 2)  # (B·G, Hkv, N, D)
        v = v.unflatten(-1, (Hkv, D)).transpose(1, 2)
        if rope is not None:
            q, k = apply_rope(q, rope[0], rope[1]), apply_rope(k, rope[0], rope[1])
        return q, k, v

    def attend(self, q: Tensor, k: Tensor, v: Tensor, lead: list[int], bias: Tensor | None = None,
               attn_mask: Tensor | None = None, key_padding_mask: Tensor | None = None, is_causal: bool = False,
               return_attn: bool = False) -> tuple[Tensor, Tensor | None]:
        """softmax(q·kᵀ/√d + bias, masked)·v, then the output projection: q (B·G, H, N, D), k and v
        (B·G, Hkv, M, D) -> (B, [G,] N, C), and the probabilities if ``return_attn``; ``lead`` is x's shape
        before N and C."""
        o, attn = attention(q, k, v, lead, bias, attn_mask, key_padding_mask, is_causal, self.backend, self.scale,
                            self.attn_drop.p if self.training else 0.0, return_attn)  # (B·G, H, N, D)
        o = self.proj_drop(self.proj(self.out_norm(o.transpose(1, 2).flatten(2))))  # (B·G, N, C)
        return o.unflatten(0, lead), attn  # (B, [G,] N, C)
