"""The attention core: the three backends agree with each other on every kind of mask, and masks mean
what they say (causality, padding, dropout only in training)."""

import logging

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from tests.backends import needs_flex
from vitkit.layers import Attention, Block, CrossAttention, DecoderBlock, KVCache, Mlp, PostNormBlock
from vitkit.layers.window import WindowAttention

B, N, M, C, H = 2, 12, 7, 32, 4

# name -> (module kwargs, forward kwargs builder)
CASES = {
    "no_mask": (dict(), lambda: dict()),
    "bias": (dict(), lambda: dict(bias=torch.randn(1, H, N, N))),
    "padding": (dict(), lambda: dict(
        key_padding_mask=torch.arange(N)[None].expand(B, N) >= torch.tensor([[N], [N - 5]]))),
    "causal": (dict(), lambda: dict(is_causal=True)),
    "causal_padding_bias": (dict(), lambda: dict(
        is_causal=True, bias=torch.randn(B, 1, N, N),
        key_padding_mask=torch.arange(N)[None].expand(B, N) >= torch.tensor([[N], [N - 3]]))),
    "cross": (dict(cls=CrossAttention), lambda: dict(memory=torch.randn(B, M, C))),
    "cross_padding": (dict(cls=CrossAttention), lambda: dict(
        memory=torch.randn(B, M, C), key_padding_mask=torch.tensor([[False] * M, [False] * 4 + [True] * 3]))),
    "gqa": (dict(num_kv_heads=2), lambda: dict(bias=torch.randn(1, H, N, N), is_causal=True)),
    "mqa": (dict(num_kv_heads=1), lambda: dict()),
    "groups_bias_mask": (dict(), lambda: dict(  # Swin-like: per-window masks, per-head bias
        x_shape=(B, 3, N, C), bias=torch.randn(1, 1, H, N, N), attn_mask=torch.rand(1, 3, 1, N, N) > 0.3)),
}


def _run(attn: Attention, backend: str, x: torch.Tensor, kw: dict) -> torch.Tensor:
    attn.backend = backend
    kw = dict(kw)
    if isinstance(attn, CrossAttention):
        return attn(x, kw.pop("memory"), **kw)
    return attn(x, **kw)


def _setup(case: str):
    mod_kw = dict(CASES[case][0])
    attn = mod_kw.pop("cls", Attention)(C, H, **mod_kw).eval()
    fwd = CASES[case][1]
    kw = fwd()
    x_shape = kw.pop("x_shape", (B, N, C))
    if "attn_mask" in kw:  # every query keeps at least its own key
        kw["attn_mask"] = kw["attn_mask"] | torch.eye(N, dtype=torch.bool)
    return attn, torch.randn(*x_shape), kw


@pytest.mark.parametrize("case", CASES)
def test_sdpa_matches_math_forward_and_backward(case):
    attn, x, kw = _setup(case)
    outs, grads = {}, {}
    for backend in ("math", "sdpa"):
        attn.zero_grad()
        xi = x.clone().requires_grad_(True)
        out = _run(attn, backend, xi, kw)
        out.square().sum().backward()
        outs[backend] = out.detach()
        grads[backend] = [xi.grad] + [p.grad.clone() for p in attn.parameters()]
    assert_close(outs["sdpa"], outs["math"], atol=1e-5, rtol=1e-5)
    for g_sdpa, g_math in zip(grads["sdpa"], grads["math"], strict=True):
        assert_close(g_sdpa, g_math, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
@needs_flex
@pytest.mark.parametrize("case", CASES)
def test_flex_matches_math_forward(case):
    attn, x, kw = _setup(case)
    with torch.no_grad():
        ref = _run(attn, "math", x, kw)
        out = _run(attn, "flex", x, kw)
    assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_flex_on_a_cpu_it_cannot_be_compiled_for_falls_back_to_sdpa_with_a_log(caplog, monkeypatch):
    from vitkit.layers import attention

    monkeypatch.setattr(attention, "flex_runs_on_cpu", lambda: False)  # as on a CPU without AVX2
    attention._warn_flex_unsupported.cache_clear()
    attn = Attention(C, H, backend="flex").eval()
    x = torch.randn(B, N, C)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="vitkit.layers.attention"):
        out = attn(x, is_causal=True)
        attn(x, is_causal=True)
        attn.backend = "sdpa"
        ref = attn(x, is_causal=True)
    assert caplog.text.count("attn_backend='flex' cannot be compiled for this CPU (it needs AVX2") == 1
    assert_close(out, ref)


@needs_flex
def test_flex_training_on_cpu_falls_back_to_sdpa_with_a_log(caplog):
    from vitkit.layers.attention import _warn_flex_fallback

    _warn_flex_fallback.cache_clear()  # logged once per process: start from a process that has not logged it
    attn = Attention(C, H, backend="flex")
    x = torch.randn(B, N, C, requires_grad=True)
    with caplog.at_level(logging.WARNING, logger="vitkit.layers.attention"):
        out = attn(x, is_causal=True)
        attn(x, is_causal=True)
    assert caplog.text.count("attn_backend='flex' has no backward on CPU; using 'sdpa'") == 1
    out.sum().backward()
    attn.backend = "sdpa"
    assert_close(out, attn(x, is_causal=True))
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_causal_output_never_depends_on_later_tokens(backend):
    attn = Attention(C, H, backend=backend).eval()
    x = torch.randn(1, N, C)
    base = attn(x, is_causal=True)
    for j in range(1, N):
        x2 = x.clone()
        x2[:, j:] = torch.randn(1, N - j, C) * 10
        out = attn(x2, is_causal=True)
        assert_close(out[:, :j], base[:, :j], atol=1e-5, rtol=1e-5)
        assert not torch.allclose(out[:, j], base[:, j])


def test_padding_keys_are_invisible():
    attn = Attention(C, H).eval()
    x = torch.randn(1, N, C)
    pad = torch.zeros(1, N + 3, dtype=torch.bool)
    pad[:, N:] = True
    x_padded = torch.cat([x, torch.randn(1, 3, C) * 100], dim=1)
    for backend in ("math", "sdpa"):
        attn.backend = backend
        assert_close(attn(x_padded, key_padding_mask=pad)[:, :N], attn(x), atol=1e-5, rtol=1e-5)


def test_math_probabilities_respect_masks_and_sum_to_one():
    attn = Attention(C, H, backend="math").eval()
    x = torch.randn(B, N, C)
    pad = torch.zeros(B, N, dtype=torch.bool)
    pad[1, -4:] = True
    _, p = attn.forward_with_attn(x, is_causal=True, key_padding_mask=pad)
    assert p.shape == (B, H, N, N)
    assert_close(p.sum(-1), torch.ones(B, H, N))
    assert (p.triu(1) == 0).all()
    assert (p[1, :, :, -4:] == 0).all()


@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_attention_dropout_only_in_training(backend):
    attn = Attention(C, H, attn_drop=0.5, backend=backend)
    ref = Attention(C, H, backend=backend)
    ref.load_state_dict(attn.state_dict())
    x = torch.randn(B, N, C)
    attn.eval(), ref.eval()
    assert_close(attn(x), ref(x))
    assert torch.equal(attn(x), attn(x))
    attn.train()
    assert not torch.allclose(attn(x), ref(x))


def test_block_dropout_and_drop_path_only_in_training():
    blk = Block(C, Attention(C, H, attn_drop=0.3, proj_drop=0.3), Mlp(C, 4 * C, drop=0.3), drop_path=0.5)
    x = torch.randn(4, N, C)
    blk.eval()
    assert torch.equal(blk(x), blk(x))
    blk.train()
    assert not torch.equal(blk(x), blk(x))


def test_kv_cache_steps_match_full_causal_attention():
    attn = Attention(C, H, num_kv_heads=2).eval()
    x = torch.randn(B, N, C)
    full = attn(x, is_causal=True)
    cache = KVCache(N)
    steps = [attn(x[:, i:i + 1], is_causal=True, cache=cache) for i in range(N)]
    assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    assert cache.length == N
    with pytest.raises(ValueError, match=f"the KV cache holds {N} tokens; {N} are written"):
        attn(x[:, :1], cache=cache)


def test_kv_cache_is_written_in_place_and_its_ring_buffer_equals_the_sliding_window():
    """The buffers are allocated once (same storage every step); with a window of 4 the ring of 4 slots gives
    what the full sequence gives under a sliding-window mask, after a prefix of 3 tokens in one step."""
    torch.manual_seed(0)
    W = 4
    attn = Attention(C, H, num_kv_heads=2).eval()
    x = torch.randn(B, N, C)
    i = torch.arange(N)
    window = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < W)
    full = attn(x, attn_mask=window)
    cache = KVCache(N, window=W)
    steps = [attn(x[:, :3], is_causal=True, cache=cache)]
    storage = cache.k.untyped_storage().data_ptr()
    steps += [attn(x[:, t:t + 1], is_causal=True, cache=cache) for t in range(3, N)]
    assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    assert cache.k.shape[-2] == W and cache.k.untyped_storage().data_ptr() == storage
    assert cache.length == W and sorted(cache.pos.tolist()) == list(range(N - W, N))


def test_blocks_are_composed_of_the_parts_they_are_given():
    """Pre-norm and post-norm residuals in the order their papers give, with the given norm layer; a decoder
    block adds cross-attention to a memory; parameter names are timm's."""
    torch.manual_seed(0)
    x, memory = torch.randn(B, N, C), torch.randn(B, M, 16)
    attn, mlp = Attention(C, H).eval(), Mlp(C, 2 * C).eval()
    pre = Block(C, attn, mlp, norm_layer=nn.RMSNorm).eval()
    assert isinstance(pre.norm1, nn.RMSNorm)
    h = x + attn(pre.norm1(x))
    assert_close(pre(x), h + mlp(pre.norm2(h)))
    post = PostNormBlock(C, attn, mlp).eval()
    h = post.norm1(x + attn(x))
    assert_close(post(x), post.norm2(h + mlp(h)))
    cross = CrossAttention(C, H, kv_dim=16).eval()
    dec = DecoderBlock(C, attn, cross, mlp).eval()
    h = x + attn(dec.norm1(x), is_causal=True)
    h = h + cross(dec.norm_cross(h), memory)
    assert_close(dec(x, memory, is_causal=True), h + mlp(dec.norm2(h)))
    assert {k.split(".")[0] for k in dec.state_dict()} == {"norm1", "attn", "norm2", "mlp", "norm_cross",
                                                           "cross_attn"}
    assert {k for k in cross.state_dict()} == {"q.weight", "q.bias", "kv.weight", "kv.bias", "proj.weight",
                                                "proj.bias"}


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="attn_backend must be one of"):
        Attention(C, H, backend="xformers")
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        Attention(C, H, num_kv_heads=3)
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(B, M\)"):
        Attention(C, H)(torch.randn(B, N, C), key_padding_mask=torch.zeros(B, N + 1, dtype=torch.bool))


@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_bf16_on_cpu_matches_float32_on_either_path(backend):
    """bf16 attention on CPU, on the explicit path and on the kernel, gives the float32 result to bf16 accuracy,
    with a bias, a per-group mask that leaves some queries no key (zeros out), and gradients."""
    torch.manual_seed(0)
    attn = WindowAttention(32, 4, (4, 4), backend=backend)
    x = torch.randn(2, 3, 16, 32)  # (B, G, N, C)
    mask = torch.rand(1, 3, 1, 16, 16) > 0.3
    mask[0, 1, 0, 5] = False  # query 5 of group 1 may attend to nothing
    ref = attn(x, attn.relative_position_bias((4, 4))[None, None], mask)
    lo = attn.to(torch.bfloat16)
    xb = x.bfloat16().requires_grad_()
    out = lo(xb, lo.relative_position_bias((4, 4))[None, None], mask)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert_close(out.float(), ref, atol=5e-2, rtol=5e-2)
    out.float().sum().backward()
    assert torch.isfinite(xb.grad).all()


def test_the_private_torch_names_the_core_relies_on_still_exist():
    """No public API exists for these (checked on torch 2.14.1); if one disappears this fails, not a silent
    fallback: flex's compiled-variant limit, the CPU's native bf16 matmul support, size-oblivious export."""
    import torch

    assert isinstance(torch._dynamo.config.recompile_limit, int)
    assert callable(torch.cpu._is_avx512_bf16_supported) and callable(torch.cpu._is_amx_tile_supported)
    assert callable(torch.cpu._is_vnni_supported)
    import torch.fx.experimental._config as fx_config  # Swin's dynamic-size export
    from torch.utils._python_dispatch import _get_current_dispatch_mode  # autotune: nothing timed under a mode

    assert hasattr(fx_config, "backed_size_oblivious") and _get_current_dispatch_mode() is None


def _slowed(monkeypatch, slow: str) -> dict[str, int]:
    """Make one path of the core 20 ms slower and count the calls of each."""
    import time

    from vitkit.layers import attention, autotune

    autotune.reset()
    calls = {"sdpa": 0, "math": 0}
    for name, fn in list(attention.BACKENDS.items()):
        if name in calls:
            def counted(*a, _fn=fn, _name=name):
                calls[_name] += 1
                if _name == slow:
                    time.sleep(0.02)
                return _fn(*a)
            monkeypatch.setitem(attention.BACKENDS, name, counted)
    return calls


@pytest.mark.parametrize("slow", ["sdpa", "math"])
@pytest.mark.parametrize("train", [False, True])
def test_auto_times_both_paths_once_per_kind_of_call_and_keeps_the_faster(slow, train, monkeypatch):
    """``auto`` on the CPU times the kernel and the explicit path at the first call of a kind (dtype, grad mode,
    mask kind, lengths rounded to powers of two; any batch) and runs the faster from then on, with the reference's
    output."""
    from vitkit.layers import autotune

    calls = _slowed(monkeypatch, slow)
    fast = "math" if slow == "sdpa" else "sdpa"
    attn, x, kw = _setup("groups_bias_mask")
    attn.train(train)
    with torch.no_grad():
        ref = _run(attn, "math", x, kw)
    calls.update(sdpa=0, math=0)
    with torch.set_grad_enabled(train):
        out = _run(attn, "auto", x, kw)
        assert calls[slow] == 1 + autotune.ROUNDS and calls[fast] == 2 + autotune.ROUNDS  # timed, then run
        calls.update(sdpa=0, math=0)
        _run(attn, "auto", x[:1], kw)  # a smaller batch: the same kind, a look-up
        assert calls == {slow: 0, fast: 1}
        with torch.no_grad() if train else torch.enable_grad():  # the other grad mode is another kind
            _run(attn, "auto", x.requires_grad_(not train), kw)
    assert calls[slow] > 0
    assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert list(autotune.choices().values())[0] == fast


def test_auto_draws_no_random_numbers_and_keeps_activation_checkpointing_consistent(monkeypatch):
    """The timed first call draws no random numbers (dropout gives the same mask as a later call), and under
    non-reentrant activation checkpointing it saves nothing of its own (checkpointing counts what a forward saves)."""
    from torch.utils.checkpoint import checkpoint

    from vitkit.layers import autotune

    autotune.reset()
    block = Block(C, Attention(C, H, attn_drop=0.3), Mlp(C, 2 * C)).train()
    x = torch.randn(B, N, C, requires_grad=True)
    torch.manual_seed(0)
    first = block(x)  # timed
    torch.manual_seed(0)
    assert torch.equal(block(x), first)
    autotune.reset()
    out = checkpoint(block, x, use_reentrant=False)  # timed inside the checkpointed forward
    out.sum().backward()
    assert torch.isfinite(x.grad).all()


def test_nothing_is_timed_in_a_traced_graph_or_under_a_dispatch_mode(monkeypatch):
    """torch.compile and the FLOP counter see the static rule: no candidate is run for timing there."""
    from torch.utils.flop_counter import FlopCounterMode

    from vitkit.layers import autotune, kernels

    calls = _slowed(monkeypatch, "math")
    attn = Attention(C, H).eval()
    x = torch.randn(B, N, C)
    counts = []
    for _ in range(2):
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            attn(x)
        counts.append(counter.get_total_flops())
    assert calls == {"sdpa": 2, "math": 0} and not autotune.choices() and counts[0] == counts[1] > 0
    seen = torch.compile(lambda t: t + (0 if autotune.can_time() else 1), backend="eager", fullgraph=True)
    assert seen(torch.zeros(1)).item() == 1 and autotune.can_time()
    q = torch.randn(B, H, N, C // H, dtype=torch.bfloat16)
    assert kernels.static_backend(q) in ("sdpa", "math")


def test_with_deterministic_algorithms_on_auto_follows_the_static_rule(monkeypatch):
    """Under ``torch.use_deterministic_algorithms`` (Lightning's ``Trainer(deterministic=True)``) nothing is timed,
    and a kind of call timed before runs the static rule's path: two runs of a program take the same paths,
    whatever the load of the machine they ran on."""
    from vitkit.layers import autotune, kernels

    calls = _slowed(monkeypatch, "sdpa")
    attn = Attention(C, H).eval()
    x = torch.randn(B, N, C)
    with torch.no_grad():
        attn(x)  # timed: math is the faster here
    assert list(autotune.choices().values()) == ["math"]
    static = kernels.static_backend(torch.randn(B, H, N, C // H))
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    calls.update(sdpa=0, math=0)
    torch.use_deterministic_algorithms(True)
    try:
        with torch.no_grad():
            attn(x)
            attn(torch.randn(B, 2 * N, C))  # a kind not seen before
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    assert calls == {static: 2, "math" if static == "sdpa" else "sdpa": 0}
    assert len(autotune.choices()) == 1  # nothing timed while deterministic


def test_sdpa_and_math_run_their_own_path_whatever_the_machine(monkeypatch):
    """A forced backend is never timed: ``sdpa`` runs the kernel and ``math`` the explicit path."""
    calls = []
    kernel = torch.nn.functional.scaled_dot_product_attention
    from vitkit.layers import attention

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    x = torch.randn(B, N, C)
    for backend, kernel_calls in (("sdpa", 1), ("math", 0)):
        calls.clear()
        with torch.no_grad():
            Attention(C, H, backend=backend).to(torch.bfloat16)(x.bfloat16())
        assert len(calls) == kernel_calls, backend
