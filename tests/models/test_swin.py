"""Swin: timm's weights load strictly and give timm's logits; windows, shifts, masks and padding behave."""

import pytest
import timm
import torch
from torch.testing import assert_close

import vitkit
from tests.backends import BACKENDS, compiled_training_step_matches_eager
from tests.inits import weightless
from vitkit.layers import Attention
from vitkit.layers.window import (
    WindowAttention,
    WindowPlan,
    relative_position_index,
    shifted_window_mask,
    window_partition,
    window_reverse,
)

TINY = dict(embed_dim=32, depths=(2, 2, 2), num_heads=(2, 2, 4), window_size=4, img_size=64)


def _pair(name: str, **kw):
    theirs = timm.create_model(name, pretrained=False, **kw).eval()
    ours = weightless(vitkit.create_model, name, **kw).eval()  # every tensor it saves is timm's next
    ours.load_state_dict(theirs.state_dict(), strict=True)
    return ours, theirs


def _check(ours, theirs, backends=("sdpa", "math"), batch=2, atol=1e-4):
    s = ours.cfg.img_size
    x = torch.randn(batch, 3, s, s)
    with torch.no_grad():
        ref = theirs(x)
        for b in backends:
            ours.set_attn_backend(b)
            assert (ours(x) - ref).abs().max().item() < atol, b


@pytest.mark.slow
@pytest.mark.parametrize("kw", [
    TINY,
    dict(TINY, window_size=(4, 4, 2)),  # per-stage windows
    dict(TINY, window_size=8),  # window as large as the 2nd map and larger than the 3rd: shrinks, no shift
    dict(embed_dim=24, depths=(1, 2), num_heads=(1, 2), window_size=3, img_size=48, patch_size=2),
], ids=["tiny", "per_stage_window", "shrinking_window", "odd_window"])
def test_tiny_configs_match_timm_on_every_backend(kw):
    """flex (a compile each) on the first config and the odd window (padded maps, a window of odd size)."""
    flex = kw is TINY or kw["window_size"] == 3
    _check(*_pair("swin_tiny_patch4_window7_224", **kw), backends=BACKENDS if flex else ("sdpa", "math"))


def test_swin_tiny_224_matches_timm():
    _check(*_pair("swin_tiny_patch4_window7_224"), batch=1)


@pytest.mark.parametrize("kw", [
    TINY,
    dict(TINY, window_size=8),  # windows that shrink to the map
    dict(TINY, pretrained_window_sizes=(2, 2, 2)),  # the bias MLP read beyond the window it was trained at
], ids=["tiny", "shrinking_window", "pretrained_window"])
def test_swinv2_tiny_configs_match_timm_on_every_backend(kw):
    """Swin V2: cosine attention (q and k unit length, the temperature folded into q), the MLP's bias, post-norm;
    flex (a compile each) on the first config only."""
    _check(*_pair("swinv2_tiny_window8_256", **kw), backends=BACKENDS if kw is TINY else ("sdpa", "math"))


@pytest.mark.slow
@pytest.mark.parametrize("name", vitkit.list_models("swinv2_*"))
def test_every_swinv2_preset_matches_timm_at_one_block_per_stage(name):
    _check(*_pair(name, depths=(1, 1, 1, 1)), batch=1)


@pytest.mark.parametrize("kw", [dict(img_size=256, window_size=8), dict(img_size=384, window_size=12)])
def test_resolution_and_window_overrides_match_timm(kw):
    _check(*_pair("swin_tiny_patch4_window7_224", depths=(2, 2, 2, 2), **kw), batch=1)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["swin_small_patch4_window7_224", "swin_base_patch4_window7_224",
                                  "swin_base_patch4_window12_384", "swin_large_patch4_window7_224"])
def test_large_presets_match_timm(name):
    _check(*_pair(name), batch=1)


def test_presets_and_overrides():
    assert set(vitkit.list_models("swin_*")) == {
        "swin_tiny_patch4_window7_224", "swin_small_patch4_window7_224", "swin_base_patch4_window7_224",
        "swin_base_patch4_window12_384", "swin_large_patch4_window7_224", "swin_large_patch4_window12_384"}
    m = vitkit.create_model("swin_tiny_patch4_window7_224", num_classes=5, drop_path_rate=0.2, attn_backend="math",
                            **{k: v for k, v in TINY.items()})
    blocks = [b for st in m.layers for b in st.blocks]
    assert blocks[0].drop_path1.p == 0 and blocks[-1].drop_path1.p == pytest.approx(0.2)
    assert all(b.attn.backend == "math" for b in blocks)
    assert m(torch.randn(2, 3, 64, 64)).shape == (2, 5)


def test_partition_and_reverse_are_inverse():
    x = torch.randn(2, 12, 8, 5)
    w = window_partition(x, (4, 4))
    assert w.shape == (2, 6, 16, 5)
    assert torch.equal(w[0, 1].reshape(4, 4, 5), x[0, :4, 4:8])
    assert torch.equal(window_reverse(w, (4, 4), 12, 8), x)
    for H, W, shifted in [(12, 8, True), (13, 9, True), (5, 7, False)]:
        plan = WindowPlan.make(H, W, (4, 4), shifted)
        y = torch.randn(2, H, W, 3)
        assert torch.equal(plan.reverse(plan.partition(y)), y)


def test_shifted_window_regions_get_exactly_zero_attention():
    """With the math backend's probabilities: after the cyclic shift, tokens from different image
    regions that share a window never attend each other."""
    H = W = 8
    plan = WindowPlan.make(H, W, (4, 4), shifted=True)
    assert plan.shift == (2, 2)
    attn = WindowAttention(16, 2, (4, 4), backend="math").eval()
    # label every token with its original (unshifted) position, then shift and window the labels
    pos = torch.arange(H * W).view(1, H, W, 1)
    pos_w = plan.partition(pos)[0, :, :, 0]  # (nW, N): original position of each windowed token
    x = plan.partition(torch.randn(1, H, W, 16))
    _, p = attn.forward_with_attn(x, attn.relative_position_bias(plan.window)[None, None], plan.mask(x.device))
    p = p.view(4, 2, 16, 16)  # (nW, heads, N, N)
    r, c = pos_w // W, pos_w % W
    # tokens are neighbours in the image iff the shift did not wrap them: same region of rows and cols
    region = ((r >= H - 2).long() * 3 + (c >= W - 2).long())
    for win in range(4):
        other = region[win][:, None] != region[win][None, :]
        assert (p[win][:, other] == 0).all()
        assert (p[win][:, ~other] > 0).all()
    # the last window mixes all four regions
    assert len(region[3].unique()) == 4


def test_mask_cache_follows_the_input_size():
    a = shifted_window_mask((8, 8), (4, 4), (2, 2), (8, 8))
    b = shifted_window_mask((12, 12), (4, 4), (2, 2), (12, 12))
    assert a.shape == (4, 16, 16) and b.shape == (9, 16, 16)
    assert shifted_window_mask((8, 8), (4, 4), (0, 0), (8, 8)) is None
    padded = shifted_window_mask((8, 8), (4, 4), (0, 0), (7, 6))  # padding only: pad keys are masked
    assert padded is not None and not padded[3, :, -1].any()


def test_relative_position_index_of_a_smaller_window_reads_the_table_centre():
    full = relative_position_index((7, 7), (7, 7))
    assert full.shape == (49, 49) and full.min() == 0 and full.max() == 13 * 13 - 1
    assert (full.diag() == 6 * 13 + 6).all()  # zero offset is the centre of the table
    small = relative_position_index((3, 3), (7, 7))
    assert (small.diag() == 6 * 13 + 6).all()
    assert small[0, 8] == (6 - 2) * 13 + (6 - 2)  # token (0,0) to (2,2): offset (-2, -2)


@pytest.mark.parametrize("size", [(61, 61), (50, 70), (100, 36), (20, 20)])
def test_any_input_size_is_padded_not_rejected(size):
    m = vitkit.create_model("swin_tiny_patch4_window7_224", **TINY).eval()
    x = torch.randn(1, 3, *size)
    with torch.no_grad():
        out = m(x)
        feats = m.forward_features(x)
    assert out.shape == (1, 1000) and torch.isfinite(out).all()
    assert feats.shape[1:3] == (-(-size[0] // 16), -(-size[1] // 16))
    m.set_attn_backend("math")
    with torch.no_grad():
        assert_close(m(x), out, atol=1e-5, rtol=1e-5)


def test_padding_does_not_leak_into_real_tokens():
    """A window that hangs over the map's edge gives its real tokens exactly what attention over the
    real tokens alone gives: padded keys are masked out."""
    from vitkit.layers import Block, Mlp

    blk = Block(16, WindowAttention(16, 2, (4, 4), backend="math"), Mlp(16, 64)).eval()
    x = torch.randn(1, 14, 14, 16)
    plan = WindowPlan.make(14, 14, (4, 4), shifted=False)
    assert plan.padded == (16, 16)
    windows = plan.partition(x)  # (1, 16, 16, 16)
    bias = blk.attn.relative_position_bias(plan.window)  # (heads, N, N)
    with torch.no_grad():
        out = blk(windows, bias[None, None], plan.mask(x.device))
        real = torch.tensor([0, 1, 4, 5])  # the corner window holds rows 12-13, cols 12-13 of the map
        # the same block on the 4 real tokens alone, with their part of the bias (the core's plain forward)
        h = windows[:, 15, real]
        h = h + Attention.forward(blk.attn, blk.norm1(h), bias=bias[:, real][:, :, real][None])
        alone = h + blk.mlp(blk.norm2(h))
    assert_close(out[:, 15, real], alone, atol=1e-6, rtol=1e-6)


def test_backward_math_matches_sdpa():
    m = vitkit.create_model("swin_tiny_patch4_window7_224", **TINY, drop_path_rate=0.0)  # deterministic
    x = torch.randn(2, 3, 64, 64)
    grads = {}
    for b in ("math", "sdpa"):
        m.zero_grad()
        m.set_attn_backend(b)
        m(x).square().mean().backward()
        grads[b] = [p.grad.clone() for p in m.parameters()]
    for g1, g2 in zip(grads["math"], grads["sdpa"], strict=True):
        assert_close(g1, g2, atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_compile_fullgraph_tiny_swin():
    """As for ViT: the forward and the training step captured whole and traced by AOTAutograd (inductor's own build
    of the step is checked on ViT). The smallest Swin that has every part: a regular and a shifted block, then
    patch merging into a second stage."""
    tiny = dict(TINY, depths=(2, 1), num_heads=(2, 2), img_size=32)
    m = vitkit.create_model("swin_tiny_patch4_window7_224", **tiny, num_classes=3).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert_close(torch.compile(m, fullgraph=True, backend="aot_eager")(x), m(x), atol=1e-5, rtol=1e-5)
    m = vitkit.create_model("swin_tiny_patch4_window7_224", **tiny, num_classes=3, drop_path_rate=0.2)
    compiled_training_step_matches_eager(m, x, backend="aot_eager")


@pytest.mark.parametrize("H,W", [(8, 8), (12, 8), (13, 9), (3, 5)])
def test_token_gathers_equal_reverse_then_partition(H, W):
    from vitkit.layers.window import token_index

    x = torch.randn(2, H, W, 3)
    a, b = WindowPlan.make(H, W, (4, 4), False), WindowPlan.make(H, W, (4, 4), True)
    flat = x.reshape(2, H * W, 3)
    wa = flat.index_select(1, token_index(None, a, x.device)).view(2, a.num_windows, -1, 3)
    wb = wa.flatten(1, 2).index_select(1, token_index(a, b, x.device)).view(2, b.num_windows, -1, 3)
    back = wb.flatten(1, 2).index_select(1, token_index(b, None, x.device)).view(2, H, W, 3)
    assert torch.equal(back, x)
    assert torch.equal(b.reverse(wb), x) and torch.equal(a.reverse(wa), x)
    if (H, W) == b.padded:  # no padding: the gathers are exactly the step-by-step windows
        assert torch.equal(wa, a.partition(x)) and torch.equal(wb, b.partition(a.reverse(wa)))


@pytest.mark.parametrize("H,W,shifted", [(13, 9, True), (8, 8, True), (5, 7, True), (12, 8, False), (3, 5, False)])
def test_index_arithmetic_equals_pad_roll_cut_and_the_sliced_region_mask(H, W, shifted):
    """The gathers and masks are built by index arithmetic (so that export can build them from symbolic sizes);
    they equal the step-by-step pad, roll and cut, and the official construction of the mask: label the padded,
    shifted map in slices (-window, -shift), cut it into windows, compare labels; padded keys never attended."""
    from vitkit.layers.window import token_index

    plan = WindowPlan.make(H, W, (4, 4), shifted)
    x = torch.randn(1, H, W, 3)
    stepwise = plan.partition(x)  # (1, nW, N, 3)
    real = plan.partition(torch.ones(1, H, W, 1))[0, :, :, 0].bool()  # (nW, N): slots holding an image token
    gathered = x.reshape(1, H * W, 3).index_select(1, token_index(None, plan, x.device)).view_as(stepwise)
    assert torch.equal(gathered[:, real], stepwise[:, real])

    (Hp, Wp), (wh, ww), (sh, sw) = plan.padded, plan.window, plan.shift
    labels, n = torch.zeros(1, Hp, Wp, 1, dtype=torch.long), 0
    for rows in ((slice(0, -wh), slice(-wh, -sh), slice(-sh, None)) if sh else (slice(None),)):
        for cols in ((slice(0, -ww), slice(-ww, -sw), slice(-sw, None)) if sw else (slice(None),)):
            labels[:, rows, cols], n = n, n + 1
    region = window_partition(labels, plan.window)[0, :, :, 0]  # (nW, N)
    expected = (region[:, :, None] == region[:, None, :]) & real[:, None, :]
    mask = plan.mask(x.device)
    if mask is None:
        assert expected.all()
    else:
        assert torch.equal(mask[0, :, 0], expected)
