"""Token merging (ToMe) on ViT: off is the plain model bit for bit; on, the model equals a plain reference of the
published algorithm written here (bipartite soft matching on the keys, size-weighted merge, proportional attention,
explicit softmax); it trains, checkpoints, compiles, traces and scripts, and Swin and RoPE models refuse it."""

import math
import re

import pytest
import torch
from torch.testing import assert_close

import vitkit
from tests.backends import needs_flex
from vitkit.errors import UsageError
from vitkit.layers.token_merging import merge_schedule

from ..commands import error_line_of

TINY = dict(img_size=32, patch_size=4, embed_dim=32, depth=3, num_heads=2, num_classes=5)


def _model(name="vit_tiny_patch16_224", **kw):
    torch.manual_seed(0)
    m = vitkit.create_model(name, **(TINY | kw)).eval()
    with torch.no_grad():  # larger than the init's weights, so that tokens differ and LayerScale matters
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return m


def _reference_merge(x, size, metric, r, protected):
    """ToMe's bipartite soft matching as published (A = even, B = odd indices of the whole sequence; protected
    tokens may neither merge away nor receive), then its weighted average; the protected tokens are put first."""
    t = x.shape[1]
    r = min(r, (t - protected) // 2)
    if r <= 0:
        return x, size
    with torch.no_grad():
        m = metric / metric.norm(dim=-1, keepdim=True)
        a, b = m[:, ::2], m[:, 1::2]
        scores = a @ b.transpose(-1, -2)
        idx = torch.arange(t)
        scores[:, idx[::2] < protected, :] = -math.inf
        scores[:, :, idx[1::2] < protected] = -math.inf
        node_max, node_idx = scores.max(dim=-1)
        edge_idx = node_max.argsort(dim=-1, descending=True)[..., None]
        unm_idx, src_idx = edge_idx[:, r:].sort(dim=1)[0], edge_idx[:, :r]
        dst_idx = node_idx[..., None].gather(dim=-2, index=src_idx)

    def merge(v):
        src, dst = v[:, ::2], v[:, 1::2]
        n, t1, c = src.shape
        unm = src.gather(-2, unm_idx.expand(n, t1 - r, c))
        src = src.gather(-2, src_idx.expand(n, r, c))
        dst = dst.scatter_reduce(-2, dst_idx.expand(n, r, c), src, reduce="sum")
        na, nb = (protected + 1) // 2, protected // 2  # protected tokens among A and among B
        first = torch.stack([unm[:, :nb], dst[:, :nb]], 2).flatten(1, 2)  # back in their order: A0 B0 A1 B1 ...
        if na > nb:
            first = torch.cat([first, unm[:, nb:na]], 1)
        return torch.cat([first, unm[:, na:], dst[:, nb:]], 1)

    x, size = merge(x * size), merge(size)
    return x / size, size


def _reference_forward(m, x, schedule):
    """The ViT's forward with ToMe as published, explicit attention and all, from the model's weights."""
    x = m._embed(x)[0]
    p, H = m.num_prefix_tokens, m.cfg.num_heads
    size = torch.ones(x.shape[0], x.shape[1], 1)
    post = m.cfg.res_post_norm  # EVA-02-E's blocks: x + norm(attn(x)), x + norm(mlp(x))
    for blk, r in zip(m.blocks, schedule, strict=True):
        h = x if post else blk.norm1(x)
        B, N, C = h.shape
        at = blk.attn
        bias = at.qkv.bias if at.q_bias is None else torch.cat([at.q_bias, torch.zeros_like(at.v_bias), at.v_bias])
        q, k, v = torch.nn.functional.linear(h, at.qkv.weight, bias).reshape(B, N, 3, H, C // H).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)) * (C // H) ** -0.5 + size.log()[:, None, None, :, 0]
        a = at.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, N, C))
        x = x + blk.ls1(blk.norm1(a) if post else a)
        x, size = _reference_merge(x, size, k.mean(1), r, p)
        f = blk.mlp(x if post else blk.norm2(x))
        x = x + blk.ls2(blk.norm2(f) if post else f)
    return m.forward_head(m.norm(x))


@pytest.mark.parametrize("name,kw", [
    ("vit_tiny_patch16_224", {}),
    ("deit_tiny_distilled_patch16_224", {}),  # class and distillation tokens
    ("vit_base_patch16_reg4_gap_256", dict(init_values=0.5)),  # 4 registers, no class token, LayerScale
    ("vit_base_patch16_siglip_224", {}),  # no prefix at all, attention-pool head
    ("eva02_enormous_patch14_clip_224", {}),  # residual post-norm blocks, q and v biases
])
@pytest.mark.parametrize("r", [5, (6, 0.5), [20, 0, 7]])
def test_merged_model_equals_the_published_algorithm(name, kw, r):
    m = _model(name, **kw)
    x = torch.randn(2, 3, 32, 32)
    m.set_token_merging(r)
    with torch.no_grad():
        ref = _reference_forward(m, x, merge_schedule(r, m.cfg.depth))
        for backend in ("sdpa", "math"):
            m.set_attn_backend(backend)
            assert_close(m(x), ref, atol=1e-5, rtol=1e-5)


def test_off_is_the_plain_model_bit_for_bit_and_on_changes_it():
    plain, merged = _model(), _model(token_merging=0)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ref = plain(x)
        assert torch.equal(merged(x), ref)
        merged.set_token_merging(8)
        assert not torch.allclose(merged(x), ref, atol=1e-3)
        assert merged.forward_features(x).shape[1] == 65 - 3 * 8  # 8 pairs merged in each of 3 blocks
        merged.set_token_merging(0)
        assert torch.equal(merged(x), ref)


def test_schedules_and_bad_values():
    assert merge_schedule(4, 3) == [4, 4, 4]
    assert merge_schedule((8, 0.5), 5) == [4, 6, 8, 10, 12]  # ToMe's linear schedule, decreasing tokens faster late
    assert merge_schedule([3, 2], 4) == [3, 2, 0, 0]
    for bad, err in [(-1, ValueError), ("8", TypeError), ([1, 2, 3, 4], ValueError), (True, TypeError)]:
        with pytest.raises(err, match="token_merging"):
            merge_schedule(bad, 3)


def test_at_most_half_the_patches_merge_in_a_block_and_the_prefix_is_kept():
    m = _model("deit_tiny_distilled_patch16_224", token_merging=100)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        tokens = m.forward_features(x)
        m.set_token_merging(0)
        plain = m.forward_features(x)
    assert tokens.shape[1] == 2 + 8  # 64 patches -> 32 -> 16 -> 8, class and distillation tokens kept
    assert plain.shape[1] == 2 + 64


def test_swin_and_rope_models_refuse_it_naming_what_takes_it():
    with pytest.raises(ValueError, match="ViT"):
        vitkit.create_model("swin_tiny_patch4_window7_224", token_merging=8)
    with pytest.raises(ValueError, match="absolute positions"):
        vitkit.create_model("vit_small_patch16_rope_224", token_merging=8, depth=1)


def test_training_gradients_reach_every_parameter_with_and_without_checkpointing():
    m = _model(token_merging=6).train()
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 5, (4,))
    grads = []
    for ckpt in (False, True):
        m.set_grad_checkpointing(ckpt)
        m.zero_grad()
        torch.nn.functional.cross_entropy(m(x), y).backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in m.parameters())
        grads.append([p.grad.clone() for p in m.parameters()])
    for a, b in zip(*grads, strict=True):
        assert_close(a, b)


def test_forward_intermediates_say_what_merged_tokens_are():
    m = _model(token_merging=8)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        final, maps = m.forward_intermediates(x)
        _, tokens = m.forward_intermediates(x, output_fmt="NLC")
        assert_close(final, m.forward_features(x))
    assert [t.shape[1] for t in tokens] == [64 - 8, 64 - 16, 64 - 24]  # each block's merged patch tokens
    assert all(mp.shape == (2, 32, 8, 8) for mp in maps)  # the grid, each patch showing its merged token
    features = vitkit.create_model("vit_tiny_patch16_224", features_only=True, out_indices=(1, 2), token_merging=8,
                                   **{k: v for k, v in TINY.items() if k != "num_classes"})
    assert [f.shape for f in features(x)] == [(2, 32, 8, 8)] * 2  # backbones keep their maps' grid
    last = maps[-1].flatten(2).transpose(1, 2)  # (B, 64, C)
    for b in range(2):  # the grid's distinct vectors are exactly the last block's tokens
        distinct = torch.unique(last[b], dim=0)
        assert distinct.shape[0] == tokens[-1].shape[1]


@pytest.mark.slow
def test_compile_script_and_trace_give_the_eager_output():
    m = _model(depth=2, token_merging=(6, 0.5))  # two blocks: compiling more only takes longer
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ref = m(x)
        assert_close(torch.jit.script(m)(x), ref)
        assert_close(torch.fx.symbolic_trace(m)(x), ref)
        # captured whole and traced by AOTAutograd (inductor's build of a ViT is checked in test_vit.py)
        assert_close(torch.compile(m, fullgraph=True, backend="aot_eager")(x), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_export_and_predict_take_token_merging_and_agree(tmp_path, capsys):
    import numpy as np
    from PIL import Image

    from vitkit.checkpoints import save_pretrained
    from vitkit.cli import main

    save_pretrained(_model(num_classes=3), tmp_path / "ckpt", class_names=["cat", "dog", "owl"])
    images = []
    for i in range(3):
        images.append(str(tmp_path / f"{i}.png"))
        Image.fromarray(np.random.default_rng(i).integers(0, 255, (40, 50, 3), dtype=np.uint8)).save(images[-1])
    assert main(["export", str(tmp_path / "ckpt"), "-o", str(tmp_path / "m.onnx"), "--token-merging", "6"]) == 0
    out = capsys.readouterr().out  # checked in onnxruntime; at the model's size unless asked (see deploy/export.py)
    assert "max |diff| against PyTorch" in out and "dynamic: batch;" in out
    assert main(["predict", *images, "--onnx", str(tmp_path / "m.onnx"), "--topk", "3"]) == 0
    onnx_lines = capsys.readouterr().out
    assert main(["predict", *images, "--checkpoint", str(tmp_path / "ckpt"), "--topk", "3",
                 "--token-merging", "6"]) == 0
    assert capsys.readouterr().out == onnx_lines
    assert re.search("ViT/DeiT presets only",
                     error_line_of(["export", "swin_tiny_patch4_window7_224", "-o", str(tmp_path / "s.onnx"),
                                    "--token-merging", "4"]))
    assert re.search("as it was exported",
                     error_line_of(["predict", *images, "--onnx", str(tmp_path / "m.onnx"), "--token-merging", "6"]))


@pytest.mark.slow
def test_onnx_export_with_dynamic_sizes_merges_as_pytorch_does_even_where_fewer_pairs_are_left(tmp_path):
    from vitkit.deploy.export import OnnxModel, export_onnx

    m = _model(depth=1, token_merging=12)
    report = export_onnx(m, tmp_path / "m.onnx", dynamic_size=True)
    assert report.dynamic == ["batch", "height", "width"]
    session = OnnxModel(tmp_path / "m.onnx")
    m.configure(dynamic_img_size=True)
    for shape in [(2, 3, 40, 28), (1, 3, 16, 12)]:  # 70 patches: 12 pairs; 12 patches: only 6 to merge
        x = torch.randn(shape)
        with torch.no_grad():
            assert_close(torch.from_numpy(session(x.numpy())), m(x), atol=1e-5, rtol=1e-5)


def test_the_bench_curve_reads_a_folder_for_checkpoints_without_a_data_module(tmp_path):
    import numpy as np
    from PIL import Image

    from vitkit.checkpoints import save_pretrained
    from vitkit.cli.bench import measure as bench

    save_pretrained(_model(num_classes=2), tmp_path / "ckpt", class_names=["a", "b"])
    with pytest.raises(UsageError, match="--val-dir"):
        bench(["--checkpoint", str(tmp_path / "ckpt"), "--token-merging", "0,8"])
    for i in range(6):
        (tmp_path / "val" / "ab"[i % 2]).mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.random.default_rng(i).integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(
            tmp_path / "val" / "ab"[i % 2] / f"{i}.png")
    (tmp_path / "val" / "a" / "broken.png").write_bytes(b"not an image")  # skipped, not fatal
    rows = bench(["--checkpoint", str(tmp_path / "ckpt"), "--val-dir", str(tmp_path / "val"), "--token-merging",
                  "0,8", "--batch-sizes", "4", "--rounds", "1", "--iters", "1", "--out", str(tmp_path / "c.csv")])
    assert [r["val_images"] for r in rows] == [6, 6] and [r["tokens_last_block"] for r in rows] == [65, 41]
    assert (tmp_path / "c.png").exists() and (tmp_path / "c.md").read_text().count("\n") == 4


@needs_flex
def test_flex_takes_the_size_term_as_its_score_mod():
    m = _model("deit_tiny_distilled_patch16_224", depth=2, token_merging=6)  # block 1 attends with log(size)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ref = _reference_forward(m, x, merge_schedule(6, 2))
        m.set_attn_backend("flex")
        assert_close(m(x), ref, atol=1e-5, rtol=1e-5)
