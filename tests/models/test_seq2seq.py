"""The encoder-decoder: masks hide what they must, cached decoding equals uncached, beam 1 equals greedy,
every position encoding and backend agrees with the reference path, and images can be the source."""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import vitkit
from tests.backends import BACKENDS
from vitkit.data.text import collate_text
from vitkit.models.seq2seq import alibi_slopes

V = 23
POS = ["sinusoidal", "learned", "rope", "alibi"]


def _model(**kw) -> torch.nn.Module:
    """A tiny model with weights spread out enough that greedy decoding produces varied tokens."""
    torch.manual_seed(0)
    m = vitkit.create_model("transformer_tiny", src_vocab_size=V, tgt_vocab_size=V, **kw).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return m


@functools.cache
def _trained(**kw) -> torch.nn.Module:
    """120 Adam steps on string reversal: enough that decoding depends on the source and the
    position, which a random model's near-constant output would not show."""
    torch.manual_seed(0)
    m = vitkit.create_model("transformer_tiny", src_vocab_size=V, tgt_vocab_size=V, dropout=0.0, **kw)
    opt = torch.optim.Adam(m.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(120):
        seqs = [torch.randint(3, V, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
                for _ in range(32)]
        src, tgt_in, tgt_out = collate_text([(s, s[::-1]) for s in seqs])
        loss = F.cross_entropy(m(src, tgt_in).flatten(0, 1), tgt_out.flatten(), ignore_index=0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return m.eval()


def _tokens(B, T, seed=0):
    return torch.randint(3, V, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("pos", POS)
@pytest.mark.parametrize("norm", ["post", "pre"])
def test_no_look_ahead(pos, norm):
    m = _model(pos_encoding=pos, norm=norm)
    src, tgt = _tokens(2, 7), _tokens(2, 9, seed=1)
    tgt2 = tgt.clone()
    tgt2[:, 5:] = _tokens(2, 4, seed=2)  # change everything after position 4
    with torch.no_grad():
        assert_close(m(src, tgt)[:, :5], m(src, tgt2)[:, :5], atol=1e-4, rtol=0)
        assert (m(src, tgt)[:, 5:] - m(src, tgt2)[:, 5:]).abs().max() > 1e-3  # the future is not ignored


@pytest.mark.parametrize("pos", POS)
def test_source_pads_are_invisible(pos):
    m = _model(pos_encoding=pos)
    src, tgt = _tokens(2, 6), _tokens(2, 5, seed=1)
    padded = torch.cat([src, torch.zeros(2, 4, dtype=torch.long)], dim=1)
    with torch.no_grad():
        assert_close(m(src, tgt), m(padded, tgt), atol=1e-4, rtol=0)


def test_target_pads_do_not_change_real_positions():
    m = _model()
    src, tgt = _tokens(2, 6), _tokens(2, 5, seed=1)
    padded = torch.cat([tgt, torch.zeros(2, 3, dtype=torch.long)], dim=1)
    with torch.no_grad():
        assert_close(m(src, tgt), m(src, padded)[:, :5], atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(pos_encoding=p) for p in POS]
                         + [dict(sliding_window=3), dict(sliding_window=3, pos_encoding="rope"),
                            dict(num_kv_heads=1), dict(num_kv_heads=2, norm="pre")],
                         ids=POS + ["window", "window_rope", "mqa", "gqa_pre"])
def test_cached_decoding_equals_uncached(kw):
    m = _trained(**kw)
    src = _tokens(3, 8)
    src[0, 6:] = 0  # a padded source row
    cached = m.generate(src, max_len=20)
    assert len(set(cached.flatten().tolist())) > 5  # not a degenerate constant output
    assert torch.equal(cached, m.generate(src, max_len=20, use_cache=False))
    beams = m.generate(src, max_len=20, beam_size=3)
    assert torch.equal(beams, m.generate(src, max_len=20, beam_size=3, use_cache=False))


def test_cached_logits_equal_teacher_forced_logits():
    m = _model(pos_encoding="alibi", sliding_window=4)
    src, tgt = _tokens(2, 6), _tokens(2, 9, seed=1)
    with torch.no_grad():
        full = m(src, tgt)
        memory, pad = m.encode(src)
        state = m.start_state(memory, pad)
        steps = torch.cat([m.decode(tgt[:, t: t + 1], memory, pad, state) for t in range(tgt.shape[1])], dim=1)
    assert_close(steps, full, atol=1e-4, rtol=0)
    assert state.self_caches[0].length == 4  # the sliding window trimmed the cache


@pytest.mark.parametrize("kw", [dict(), dict(pos_encoding="alibi", sliding_window=4)], ids=["full", "window"])
def test_a_compiled_decode_step_compiles_once(kw):
    """The cache is allocated up front with fixed shapes and keeps its positions in tensors, so a compiled decode
    step builds one graph and reuses it at every later step (a ring buffer under a sliding window), giving the
    eager step's logits."""
    m = _model(**kw)
    src, tgt = _tokens(2, 6), _tokens(2, 10, seed=1)
    graphs = []

    def counting(gm, example_inputs):  # a torch.compile backend that runs the graph as traced, and counts it
        graphs.append(gm)
        return gm.forward

    step = torch.compile(m.decode, backend=counting, dynamic=False)
    with torch.no_grad():
        memory, pad = m.encode(src)
        state, ref_state = m.start_state(memory, pad, 10), m.start_state(memory, pad, 10)
        for t in range(10):
            out = step(tgt[:, t: t + 1], memory, pad, state, True)
            assert_close(out, m.decode(tgt[:, t: t + 1], memory, pad, ref_state, True), atol=1e-5, rtol=1e-5)
    assert len(graphs) == 1


@pytest.mark.slow
def test_beam_one_is_greedy_and_wider_beams_score_at_least_as_well():
    m = _trained()
    src = _tokens(4, 7)
    greedy = m.generate(src, max_len=15)
    assert torch.equal(m.generate(src, max_len=15, beam_size=1, length_penalty=0.6), greedy)
    beam = m.generate(src, max_len=15, beam_size=4, length_penalty=0.0)  # alpha 0: plain log-probability

    def logprob(out):
        bos = torch.full((out.shape[0], 1), 1, dtype=torch.long)
        tgt_in = torch.cat([bos, out[:, :-1]], dim=1)
        with torch.no_grad():
            lp = m(src, tgt_in).log_softmax(-1).gather(-1, out[..., None])[..., 0]
        ends = (out == 2).int().cumsum(1) - (out == 2).int()  # > 0 after the first EOS
        return lp.masked_fill((ends > 0) | (out == 0), 0).sum(1)

    finished = (greedy == 2).any(1) & (beam == 2).any(1)
    assert finished.any()
    assert (logprob(beam)[finished] >= logprob(greedy)[finished] - 1e-4).all()


@pytest.mark.parametrize("pos", ["sinusoidal", "alibi"])
def test_backends_agree(pos):
    m = _model(pos_encoding=pos, sliding_window=5, num_kv_heads=2)
    src, tgt = _tokens(2, 7), _tokens(2, 9, seed=1)
    src[1, 5:] = 0
    with torch.no_grad():
        ref = m(src, tgt)
        for backend in BACKENDS[1:]:
            m.set_attn_backend(backend)
            assert_close(m(src, tgt), ref, atol=1e-4, rtol=0)


def test_shared_embeddings_and_tied_output():
    m = vitkit.create_model("transformer_tiny", src_vocab_size=V, tgt_vocab_size=V, share_embeddings=True)
    assert m.src_embed.weight is m.tgt_embed.weight is m.out.weight
    with pytest.raises(ValueError, match="share_embeddings needs one vocabulary"):
        vitkit.create_model("transformer_tiny", src_vocab_size=V, tgt_vocab_size=V + 1, share_embeddings=True)


def test_presets_have_the_papers_sizes():
    base = vitkit.create_model("transformer_base", src_vocab_size=37000, tgt_vocab_size=37000,
                               share_embeddings=True)
    assert sum(p.numel() for p in base.parameters()) / 1e6 == pytest.approx(63.1, abs=0.5)  # 65M with biases etc.
    cfg = vitkit.get_config("transformer_big")
    assert (cfg.d_model, cfg.num_heads, cfg.d_ff, cfg.dropout) == (1024, 16, 4096, 0.3)
    assert (cfg.pad_id, cfg.bos_id, cfg.eos_id) == (0, 1, 2)


def test_alibi_slopes_follow_the_paper():
    assert_close(alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))
    assert len(alibi_slopes(12)) == 12


@pytest.mark.parametrize("name", ["ocr_vit_tiny", "ocr_swin_tiny"])
def test_image_to_text_reads_vision_tokens(name):
    torch.manual_seed(0)
    m = vitkit.create_model(name, tgt_vocab_size=14).eval()
    img = torch.randn(2, 1, 16, 64)
    tgt = torch.randint(3, 14, (2, 5))
    assert m(img, tgt).shape == (2, 5, 14)
    assert torch.equal(m.generate(img, max_len=6), m.generate(img, max_len=6, use_cache=False))


def test_bad_source_is_a_clear_error():
    m = _model()
    with pytest.raises(ValueError, match=r"source must be token ids \(B, S\)"):
        m(torch.randn(2, 5), _tokens(2, 3))
