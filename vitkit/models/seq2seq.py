"""The Transformer encoder-decoder (Vaswani et al., 2017) on vitkit's Block and attention core.

The encoder is a stack of self-attention blocks; the decoder block adds causal self-attention and
cross-attention (:class:`vitkit.layers.DecoderBlock`). The same decoder reads a ViT or Swin encoder's tokens
for image-to-text. Position encodings: the paper's sinusoids, learned, RoPE (q and k rotated inside the
attention core) or ALiBi (an additive bias). Decoding: greedy or beam search, with a self-attention KV cache
allocated once and written in place (a ring buffer under a sliding window) and cross-attention K/V projected
once.

Shape legend: B batch, S source tokens, T target tokens, V vocabulary, C d_model, H heads, K beams.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vitkit.errors import UsageError

from ..layers import (
    Attention,
    AttnBackend,
    Block,
    CrossAttention,
    DecoderBlock,
    KVCache,
    MemoryKV,
    Mlp,
    PostNormBlock,
    PostNormDecoderBlock,
    sinusoidal_1d,
)
from ..layers.attention import check_backend
from .encoders import vision_encoder

PosEncoding = Literal["sinusoidal", "learned", "rope", "alibi"]


@dataclass
class Seq2SeqConfig:
    """Everything that defines an encoder-decoder; presets below are rows of overrides to it."""

    src_vocab_size: int = 1000
    tgt_vocab_size: int = 1000
    d_model: int = 512
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    num_heads: int = 8
    num_kv_heads: int | None = None  # < num_heads: grouped-query (1: multi-query) attention
    d_ff: int = 2048
    dropout: float = 0.1  # on embeddings and every residual branch (P_drop of the paper)
    attn_dropout: float = 0.1  # on the attention probabilities
    pos_encoding: PosEncoding = "sinusoidal"
    max_len: int = 1024  # longest sequence for sinusoidal / learned tables
    norm: Literal["post", "pre"] = "post"  # post-LN as in the paper; pre-LN trains deep stacks more easily
    norm_eps: float = 1e-5
    share_embeddings: bool = False  # one table for source and target (needs one vocabulary)
    tie_output: bool = True  # the output projection reuses the target embedding (paper, §3.4)
    sliding_window: int | None = None  # decoder self-attention sees the last `sliding_window` tokens
    label_smoothing: float = 0.1  # used by the Lightning module
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    vision_encoder: str | None = None  # a ViT / Swin preset: image-to-text, the source is images
    vision_overrides: dict[str, Any] = field(default_factory=dict)
    attn_backend: AttnBackend = "auto"

    def __post_init__(self) -> None:
        check_backend(self.attn_backend)
        if self.pos_encoding not in ("sinusoidal", "learned", "rope", "alibi"):
            raise UsageError(f"pos_encoding must be sinusoidal, learned, rope or alibi, got {self.pos_encoding!r}")
        if self.norm not in ("post", "pre"):
            raise UsageError(f"norm must be 'post' or 'pre', got {self.norm!r}")
        if self.d_model % self.num_heads:
            raise UsageError(f"d_model ({self.d_model}) must be divisible by num_heads ({self.num_heads})")
        if self.share_embeddings and self.src_vocab_size != self.tgt_vocab_size:
            raise UsageError(f"share_embeddings needs one vocabulary, got src {self.src_vocab_size} "
                             f"and tgt {self.tgt_vocab_size}")


def alibi_slopes(num_heads: int) -> Tensor:
    """Press et al. (2022): geometric slopes 2^(-8/H), 2^(-16/H), ... (interleaved when H is not 2^k)."""
    def pow2(n: int) -> list[float]:
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]

    p = 2 ** math.floor(math.log2(num_heads))
    slopes = pow2(p) + pow2(2 * p)[0::2][: num_heads - p]
    return torch.tensor(slopes)


class Positions(nn.Module):
    """Adds the position signal of the chosen kind to scaled token embeddings, then dropout.

    For ``rope`` / ``alibi`` nothing is added here; :meth:`rope` / :meth:`alibi` give what the
    attention core takes (rotation tables, an additive bias) for given query and key positions."""

    def __init__(self, cfg: Seq2SeqConfig) -> None:
        super().__init__()
        self.kind = cfg.pos_encoding
        self.drop = nn.Dropout(cfg.dropout)
        head_dim = cfg.d_model // cfg.num_heads
        if self.kind == "sinusoidal":
            self.register_buffer("table", sinusoidal_1d(cfg.max_len, cfg.d_model), persistent=False)
        elif self.kind == "learned":
            self.table = nn.Parameter(torch.randn(cfg.max_len, cfg.d_model) * 0.02)
        elif self.kind == "rope":
            if head_dim % 2:
                raise UsageError(f"rope needs an even head dim, got {head_dim}")
            inv = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)  # (D/2,)
            self.register_buffer("inv_freq", inv, persistent=False)
        else:
            self.register_buffer("slopes", alibi_slopes(cfg.num_heads), persistent=False)
        self.max_len = cfg.max_len

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        """Embeddings (B, T, C) of the tokens at ``positions`` (T,) -> (B, T, C)."""
        if self.kind in ("sinusoidal", "learned"):
            if not torch.compiler.is_compiling() and int(positions[-1]) >= self.max_len:
                raise UsageError(f"sequence of {int(positions[-1]) + 1} tokens is longer than max_len={self.max_len}")
            x = x + self.table[positions].to(x.dtype)
        return self.drop(x)

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor] | None:
        if self.kind != "rope":
            return None
        angles = positions.float()[:, None] * self.inv_freq  # (T, D/2)
        return angles.cos(), angles.sin()

    def alibi(self, q_pos: Tensor, k_pos: Tensor, causal: bool) -> Tensor | None:
        """(1, H, T, S) bias: -slope x distance (keys ahead of a causal query are masked elsewhere)."""
        if self.kind != "alibi":
            return None
        dist = (q_pos[:, None] - k_pos[None, :]).float()  # (T, S)
        dist = dist.clamp(min=0) if causal else dist.abs()
        return (-self.slopes[:, None, None] * dist)[None]


def _padding(tokens: Tensor, pad_id: int) -> Tensor | None:
    pad = tokens == pad_id
    return pad if bool(pad.any()) else None


@dataclass
class DecoderState:
    """Per-layer caches of one decoding run: self-attention K/V are written step by step, cross-attention K/V
    are projected once."""

    self_caches: list[KVCache]
    cross_caches: list[MemoryKV]
    memory: Tensor
    memory_padding_mask: Tensor | None
    step: int = 0  # tokens fed so far (set by generate; decode reads positions from the caches)

    def reorder(self, index: Tensor) -> None:
        for c in self.self_caches:
            c.reorder(index)


class Seq2SeqTransformer(nn.Module):
    """The original Transformer; with ``vision_encoder`` set, its decoder reads a ViT / Swin instead."""

    def __init__(self, cfg: Seq2SeqConfig) -> None:
        super().__init__()
        self.cfg = cfg
        C = cfg.d_model
        self.tgt_embed = nn.Embedding(cfg.tgt_vocab_size, C, padding_idx=cfg.pad_id)
        if cfg.vision_encoder is not None:
            self.vision = vision_encoder(cfg.vision_encoder, **cfg.vision_overrides)
            memory_dim = self.vision.num_features
        else:
            self.src_embed = self.tgt_embed if cfg.share_embeddings else nn.Embedding(
                cfg.src_vocab_size, C, padding_idx=cfg.pad_id)
            self.src_pos = Positions(cfg)
            self.encoder = nn.ModuleList([self._encoder_block() for _ in range(cfg.num_encoder_layers)])
            self.encoder_norm = nn.LayerNorm(C, eps=cfg.norm_eps) if cfg.norm == "pre" else nn.Identity()
            memory_dim = C
        self.tgt_pos = Positions(cfg)
        self.embed_scale = math.sqrt(C)  # embeddings are multiplied by √d_model (§3.4)
        self.decoder = nn.ModuleList([self._decoder_block(memory_dim) for _ in range(cfg.num_decoder_layers)])
        self.decoder_norm = nn.LayerNorm(C, eps=cfg.norm_eps) if cfg.norm == "pre" else nn.Identity()
        self.out = nn.Linear(C, cfg.tgt_vocab_size, bias=False)
        self.reset_parameters()
        if cfg.tie_output:
            self.out.weight = self.tgt_embed.weight

    def _attention(self, cls: type[Attention] = Attention, **kw: Any) -> Attention:
        cfg = self.cfg
        return cls(cfg.d_model, cfg.num_heads, num_kv_heads=cfg.num_kv_heads, attn_drop=cfg.attn_dropout,
                   proj_drop=cfg.dropout, backend=cfg.attn_backend, **kw)

    def _encoder_block(self) -> Block:
        cfg = self.cfg
        block = PostNormBlock if cfg.norm == "post" else Block
        return block(cfg.d_model, self._attention(), Mlp(cfg.d_model, cfg.d_ff, drop=cfg.dropout),
                     norm_layer=partial(nn.LayerNorm, eps=cfg.norm_eps))

    def _decoder_block(self, memory_dim: int) -> DecoderBlock:
        cfg = self.cfg
        block = PostNormDecoderBlock if cfg.norm == "post" else DecoderBlock
        return block(cfg.d_model, self._attention(), self._attention(CrossAttention, kv_dim=memory_dim),
                     Mlp(cfg.d_model, cfg.d_ff, drop=cfg.dropout), norm_layer=partial(nn.LayerNorm, eps=cfg.norm_eps))

    def reset_parameters(self) -> None:
        """Xavier-uniform matrices (as the reference implementations), N(0, C^-1/2) embeddings."""
        for name, p in self.named_parameters():
            if name.startswith("vision."):
                continue
            if "embed" in name:
                nn.init.normal_(p, std=self.cfg.d_model**-0.5)
                with torch.no_grad():
                    p[self.cfg.pad_id].zero_()
            elif p.dim() > 1 and not name.endswith("pos.table"):  # learned positions keep their N(0, 0.02)
                nn.init.xavier_uniform_(p)

    def set_attn_backend(self, backend: AttnBackend) -> None:
        self.cfg.attn_backend = check_backend(backend)
        for m in self.modules():
            if isinstance(m, Attention):
                m.backend = backend

    def no_weight_decay(self) -> set[str]:
        return {"table"}

    # -- encoder -----------------------------------------------------------------------------------

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor | None]:
        """Source tokens (B, S) or images (B, 3, H, W) -> memory (B, M, C_mem) and its padding mask."""
        if self.cfg.vision_encoder is not None:
            feats = self.vision.forward_features(src)  # (B, N, C) for ViT, (B, h, w, C) for Swin
            return feats.flatten(1, -2), None
        if src.dim() != 2 or src.dtype not in (torch.long, torch.int, torch.int32):
            raise UsageError(f"source must be token ids (B, S) of an integer dtype, got {src.dtype} {tuple(src.shape)}")
        pad = _padding(src, self.cfg.pad_id)
        pos = torch.arange(src.shape[1], device=src.device)
        rope, bias = self.src_pos.rope(pos), self.src_pos.alibi(pos, pos, causal=False)
        x = self.src_pos(self.src_embed(src) * self.embed_scale, pos)
        for blk in self.encoder:
            x = blk(x, key_padding_mask=pad, rope=rope, bias=bias)
        return self.encoder_norm(x), pad

    # -- decoder -----------------------------------------------------------------------------------

    @staticmethod
    def _window_mask(q_pos: Tensor, k_pos: Tensor, W: int | None) -> Tensor | None:
        """Sliding window: query i sees keys i-W < j <= i ((T, S) bool); None leaves plain causality."""
        if W is None:
            return None
        d = q_pos[:, None] - k_pos[None, :]
        return (d >= 0) & (d < W)

    def decode(self, tgt_in: Tensor, memory: Tensor, memory_padding_mask: Tensor | None = None,
               state: DecoderState | None = None, last_only: bool = False) -> Tensor:
        """Target tokens (B, T) -> logits (B, T, V); with ``state``, tgt_in continues the cached prefix.
        ``last_only`` projects only the last position to the vocabulary ((B, 1, V), for decoding)."""
        T, dev = tgt_in.shape[1], tgt_in.device
        if state is None:
            q_pos = k_pos = torch.arange(T, device=dev)
        else:  # positions of this step's queries, and of the cache's keys once this step is written
            q_pos, k_pos = state.self_caches[0].positions(T)
        rope, bias = self.tgt_pos.rope(q_pos), self.tgt_pos.alibi(q_pos, k_pos, causal=True)
        # with a cache, causality and the sliding window come from the cache's positions
        mask = self._window_mask(q_pos, k_pos, self.cfg.sliding_window) if state is None else None
        pad = _padding(tgt_in, self.cfg.pad_id) if state is None else None
        x = self.tgt_pos(self.tgt_embed(tgt_in) * self.embed_scale, q_pos)
        for i, blk in enumerate(self.decoder):
            x = blk(x, memory, memory_padding_mask=memory_padding_mask,
                    memory_cache=state.cross_caches[i] if state is not None else None,
                    is_causal=True, key_padding_mask=pad, rope=rope, bias=bias, attn_mask=mask,
                    cache=state.self_caches[i] if state is not None else None)
        return self.out(self.decoder_norm(x[:, -1:] if last_only else x))

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """Teacher forcing: logits (B, T, V) for tgt_in = [bos, y_1, ..., y_{T-1}]."""
        memory, pad = self.encode(src)
        return self.decode(tgt_in, memory, pad)

    # -- generation --------------------------------------------------------------------------------

    def start_state(self, memory: Tensor, memory_padding_mask: Tensor | None,
                    size: int | None = None) -> DecoderState:
        """Caches for decoding up to ``size`` tokens (default ``max_len``); the memory's K/V projected now."""
        cfg = self.cfg
        cross = [MemoryKV(*blk.cross_attn.project_kv(memory)) for blk in self.decoder]
        caches = [KVCache(size or cfg.max_len, window=cfg.sliding_window) for _ in self.decoder]
        for cache, kv in zip(caches, cross, strict=True):  # allocated here, so a compiled step never allocates
            cache.allocate(memory.shape[0], cfg.num_kv_heads or cfg.num_heads, cfg.d_model // cfg.num_heads,
                           kv.k.dtype, memory.device)
        return DecoderState(caches, cross, memory, memory_padding_mask)

    def _next_logprobs(self, tokens: Tensor, state: DecoderState, use_cache: bool) -> Tensor:
        """Log-probabilities (B, V) of the token after ``tokens`` (B, t)."""
        if use_cache:
            logits = self.decode(tokens[:, state.step:], state.memory, state.memory_padding_mask, state, True)
            state.step = tokens.shape[1]
        else:  # recompute the whole prefix: the reference, and the baseline of the cache's speed-up
            logits = self.decode(tokens, state.memory, state.memory_padding_mask, last_only=True)
        return F.log_softmax(logits[:, -1].float(), dim=-1)

    @torch.no_grad()
    def generate(self, src: Tensor, max_len: int = 128, beam_size: int = 1, length_penalty: float = 0.6,
                 use_cache: bool = True) -> Tensor:
        """Decode token ids (B, T): greedy with ``beam_size=1``, beam search above.

        The output starts after BOS, includes EOS when one was produced, and is padded with pad_id.
        Beam scores are divided by GNMT's length penalty ((5 + len) / 6) ** length_penalty."""
        memory, pad = self.encode(src)
        if beam_size > 1:
            return self._beam_search(memory, pad, max_len, beam_size, length_penalty, use_cache)
        cfg, B = self.cfg, memory.shape[0]
        tokens = torch.full((B, 1), cfg.bos_id, dtype=torch.long, device=memory.device)
        done = torch.zeros(B, dtype=torch.bool, device=memory.device)
        state = self.start_state(memory, pad, max_len)
        for _ in range(max_len):
            nxt = self._next_logprobs(tokens, state, use_cache).argmax(-1)
            nxt = nxt.masked_fill(done, cfg.pad_id)
            tokens = torch.cat([tokens, nxt[:, None]], dim=1)
            done |= nxt == cfg.eos_id
            if bool(done.all()):
                break
        return tokens[:, 1:]

    def _beam_search(self, memory: Tensor, pad: Tensor | None, max_len: int, K: int, alpha: float,
                     use_cache: bool) -> Tensor:
        """K live hypotheses per input. An input is done once K hypotheses have ended with EOS and no live
        one scores better than the worst of them (with K=1 this is exactly greedy decoding, and with
        length_penalty 0 the search never stops while a live hypothesis could still win). Rows of the
        (B·K) batch are beams, b·K + k."""
        cfg, B, dev = self.cfg, memory.shape[0], memory.device
        state = self.start_state(memory.repeat_interleave(K, dim=0),  # (B·K, M, C), cross K/V made once
                                 pad.repeat_interleave(K, dim=0) if pad is not None else None, max_len)
        tokens = torch.full((B * K, 1), cfg.bos_id, dtype=torch.long, device=dev)
        scores = torch.full((B, K), float("-inf"), device=dev)
        scores[:, 0] = 0.0  # all beams start identical: expand only the first
        finished: list[list[tuple[float, Tensor]]] = [[] for _ in range(B)]  # (normalised score, tokens)
        done = [False] * B

        def penalty(n: int) -> float:
            return ((5 + n) / 6) ** alpha

        for step in range(1, max_len + 1):
            logp = self._next_logprobs(tokens, state, use_cache)  # (B·K, V)
            V = logp.shape[-1]
            cand = (scores[:, :, None] + logp.view(B, K, V)).view(B, K * V)
            top_scores, top_idx = cand.topk(2 * K, dim=-1)  # (B, 2K): at most K end, K stay live
            rows, toks, new_scores = [], [], []
            for b in range(B):
                live = []
                for s, i in zip(top_scores[b].tolist(), top_idx[b].tolist(), strict=True):
                    if len(live) == K or done[b] or s == float("-inf"):
                        break
                    beam, tok = divmod(i, V)
                    if tok == cfg.eos_id:
                        seq = torch.cat([tokens[b * K + beam, 1:], tokens.new_tensor([tok])])
                        finished[b].append((s / penalty(step), seq))
                    else:
                        live.append((b * K + beam, tok, s))
                live += [(b * K, cfg.pad_id, float("-inf"))] * (K - len(live))  # empty slots
                for row, tok, s in live:
                    rows.append(row)
                    toks.append(tok)
                    new_scores.append(s)
            index = torch.tensor(rows, device=dev)
            tokens = torch.cat([tokens[index], torch.tensor(toks, device=dev)[:, None]], dim=1)
            scores = torch.tensor(new_scores, device=dev).view(B, K)
            state.reorder(index)
            for b in range(B):
                finished[b] = sorted(finished[b], key=lambda h: -h[0])[:K]
                best_live = scores[b].max().item() / penalty(step)
                done[b] = done[b] or (len(finished[b]) == K and best_live <= finished[b][-1][0])
            if all(done):
                break
        out = []
        for b in range(B):
            hyps = list(finished[b])
            if len(hyps) < K:  # stopped by max_len: the live beams compete too
                n = tokens.shape[1] - 1
                hyps += [(scores[b, k].item() / penalty(n), tokens[b * K + k, 1:]) for k in range(K)
                         if scores[b, k] > float("-inf")]
            out.append(max(hyps, key=lambda h: h[0])[1])
        T = max(len(t) for t in out)
        return torch.stack([F.pad(t, (0, T - len(t)), value=cfg.pad_id) for t in out])


# Keyed by the names users know; all take src_vocab_size / tgt_vocab_size.
SEQ2SEQ_PRESETS: dict[str, dict] = {
    "transformer_tiny": dict(d_model=64, num_encoder_layers=2, num_decoder_layers=2, num_heads=4, d_ff=256,
                             dropout=0.1, attn_dropout=0.0, max_len=256),
    "transformer_base": dict(d_model=512, num_encoder_layers=6, num_decoder_layers=6, num_heads=8, d_ff=2048,
                             dropout=0.1),
    "transformer_big": dict(d_model=1024, num_encoder_layers=6, num_decoder_layers=6, num_heads=16, d_ff=4096,
                            dropout=0.3),
    # image-to-text: a small decoder reading a small ViT / Swin over 16x64 grey images (1-4 digits)
    "ocr_vit_tiny": dict(d_model=96, num_encoder_layers=0, num_decoder_layers=2, num_heads=4, d_ff=384,
                         dropout=0.1, attn_dropout=0.0, max_len=64, norm="pre", vision_encoder="vit_tiny_patch16_224",
                         vision_overrides=dict(img_size=(16, 64), in_chans=1, patch_size=4, embed_dim=96, depth=3,
                                               num_heads=3)),
    "ocr_swin_tiny": dict(d_model=96, num_encoder_layers=0, num_decoder_layers=2, num_heads=4, d_ff=384,
                          dropout=0.1, attn_dropout=0.0, max_len=64, norm="pre",
                          vision_encoder="swin_tiny_patch4_window7_224",
                          vision_overrides=dict(img_size=(16, 64), in_chans=1, patch_size=2, embed_dim=48,
                                                depths=(2, 2), num_heads=(2, 4), window_size=4)),
}
