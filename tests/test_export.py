"""ONNX and torch.export: onnxruntime against PyTorch on tiny ViT and Swin configs (two batch sizes, non-square
sizes, every distinct ViT variant among the presets), the metadata round trip, the .pt2 round trip, clear
errors, and the command line (export, then predict --onnx prints what the PyTorch path prints)."""

import json
import re
import subprocess
import sys
from dataclasses import fields

import numpy as np
import pytest
import torch

import vitkit
from vitkit import family
from vitkit.deploy.export import (
    ExportError,
    OnnxModel,
    export_onnx,
    export_program,
    metadata,
    min_size,
    read_program_metadata,
)

from .commands import error_line_of

pytestmark = pytest.mark.slow

pytest.importorskip("onnxruntime")

TINY_VIT = dict(depth=1, embed_dim=32, num_heads=2, patch_size=8)
TINY_SWIN = dict(embed_dim=16, depths=[1, 1], num_heads=[1, 2], window_size=2, patch_size=2)
SIZES = ("img_size", "patch_size", "embed_dim", "depth", "num_heads", "mlp_ratio", "num_classes", "drop_path_rate",
         "mean", "std", "crop_pct", "interpolation")


def _variants() -> list[str]:
    """Three much-exported ViT presets, and as few more as it takes (a greedy cover) for every value of every
    architecture choice among the presets (class and register tokens, pooling, fc_norm, position scheme,
    pre-norm, LayerScale, ...) to appear; the other presets differ from these in sizes or combination only."""
    choices = {}
    for name in vitkit.list_models():
        if family(name) == "vit":
            cfg = vitkit.get_config(name)
            choices[name] = {(f.name, getattr(cfg, f.name) is not None if f.name == "init_values"
                              else repr(getattr(cfg, f.name))) for f in fields(cfg) if f.name not in SIZES}
    out = ["vit_base_patch16_224", "vit_small_patch14_dinov2", "vit_base_patch16_siglip_gap_224"]  # much exported
    todo = set().union(*choices.values()) - set().union(*(choices[n] for n in out))
    while todo:
        best = max(choices, key=lambda n: len(choices[n] & todo))
        out.append(best)
        todo -= choices[best]
    return out


@pytest.mark.parametrize("name", _variants())
def test_every_vit_variant_exports_with_dynamic_batch_and_size(name, tmp_path):
    m = vitkit.create_model(name, img_size=(32, 48), num_classes=7, **TINY_VIT).eval()
    report = export_onnx(m, tmp_path / "m.onnx")
    assert report.dynamic == ["batch", "height", "width"] and report.max_abs_diff <= 1e-4
    m.configure(dynamic_img_size=True)  # the exported graph resamples positions per input, as timm's flag does
    session = OnnxModel(tmp_path / "m.onnx")
    with torch.no_grad():
        for shape in [(4, 3, 32, 48), (2, 3, 56, 24)]:
            x = torch.randn(shape)
            np.testing.assert_allclose(session(x.numpy()), m(x).numpy(), atol=1e-4, rtol=0)


def test_swin_exports_with_dynamic_batch_and_size_down_to_one_window_per_stage(tmp_path):
    """One graph for every size whose stage maps still hold a whole window: padded sizes, the smallest (the last
    stage one unshifted window), and sizes where the last stage shifts; a smaller input is refused by name."""
    m = vitkit.create_model("swin_tiny_patch4_window7_224", img_size=(32, 48), num_classes=5, **TINY_SWIN).eval()
    report = export_onnx(m, tmp_path / "m.onnx")
    assert report.dynamic == ["batch", "height", "width"] and report.max_abs_diff <= 1e-4
    assert min_size(m) == (5, 5)  # patch 2, window 2, two stages: ceil(ceil(5 / 2) / 2) = 2
    session = OnnxModel(tmp_path / "m.onnx")
    with torch.no_grad():
        for shape in [(1, 3, 32, 48), (4, 3, 33, 47), (1, 3, 5, 5), (2, 3, 6, 9), (2, 3, 61, 17)]:
            x = torch.randn(shape)
            np.testing.assert_allclose(session(x.numpy()), m(x).numpy(), atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match=r"expects \(B, 3, H, W\) float32 with H >= 5 and W >= 5 \(exported at "
                       r"32x48\), got shape \(1, 3, 4, 9\)"):
        session(np.zeros((1, 3, 4, 9), np.float32))


def test_swin_exports_at_a_fixed_size_that_needs_padding_and_names_wrong_input(tmp_path):
    m = vitkit.create_model("swin_tiny_patch4_window7_224", img_size=(30, 46), num_classes=5, **TINY_SWIN).eval()
    report = export_onnx(m, tmp_path / "m.onnx", dynamic_size=False)
    assert report.dynamic == ["batch"] and report.max_abs_diff <= 1e-4
    x = torch.randn(4, 3, 30, 46)
    o = OnnxModel(tmp_path / "m.onnx")
    with torch.no_grad():
        np.testing.assert_allclose(o(x.numpy()), m(x).numpy(), atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match=r"expects \(B, 3, 30, 46\) float32, got shape \(2, 3, 40, 46\)"):
        o(np.zeros((2, 3, 40, 46), np.float32))
    with pytest.raises(ValueError, match=r"expects \(B, 3, 30, 46\) float32, got shape \(3, 30, 46\)"):
        o(np.zeros((3, 30, 46), np.float32))
    with pytest.raises(TypeError, match=r"expects \(B, 3, 30, 46\) float32, got dtype uint8"):
        o(np.zeros((1, 3, 30, 46), np.uint8))


def test_metadata_carries_preprocessing_and_labels(tmp_path):
    m = vitkit.create_model("deit_tiny_patch16_224", img_size=32, num_classes=3, **TINY_VIT).eval()
    m.class_names = ["cat", "dog", "owl"]
    export_onnx(m, tmp_path / "m.onnx", dynamic_size=False)
    o = OnnxModel(tmp_path / "m.onnx")
    cfg = m.cfg
    assert o.name == "deit_tiny_patch16_224" and o.labels == ["cat", "dog", "owl"]
    assert o.meta["input_size"] == [3, 32, 32] and o.meta["dynamic_size"] is False
    assert (tuple(o.meta["mean"]), tuple(o.meta["std"]), o.meta["crop_pct"], o.meta["interpolation"]) == \
        (tuple(cfg.mean), tuple(cfg.std), cfg.crop_pct, cfg.interpolation)
    import onnx

    assert onnx.load(str(tmp_path / "m.onnx")).opset_import[0].version >= 18


def test_torch_export_program_loads_back_with_the_same_logits(tmp_path):
    """Swin's dynamic .pt2 here (ViT's is written by the command-line test below, and checked by the export)."""
    m = vitkit.create_model("swin_tiny_patch4_window7_224", img_size=32, num_classes=4, **TINY_SWIN).eval()
    report = export_program(m, tmp_path / "m.pt2")
    assert report.format == "torch-export" and report.dynamic == ["batch", "height", "width"]
    loaded = torch.export.load(str(tmp_path / "m.pt2")).module()
    with torch.no_grad():
        for x in (torch.randn(3, 3, 32, 32), torch.randn(1, 3, 37, 21)):
            torch.testing.assert_close(loaded(x), m(x), atol=1e-5, rtol=0)
    with pytest.raises(AssertionError, match=r"x.size\(\)\[2\] >= 5"):  # below one window per stage
        loaded(torch.randn(1, 3, 4, 32))
    meta = read_program_metadata(tmp_path / "m.pt2")  # the ONNX file's metadata, beside the program
    assert meta["input_size"] == [3, 32, 32] and meta["mean"] == list(m.cfg.mean) and meta["thresholds"] is None
    m.thresholds, m.class_names = [0.3, 0.4, 0.5, 0.6], list("abcd")  # a multi-label classifier's, as both write it
    assert json.loads(metadata(m, True)["vitkit.thresholds"]) == [0.3, 0.4, 0.5, 0.6]


def test_wrong_input_and_unsupported_models_get_named_errors(tmp_path):
    v = vitkit.create_model("vit_small_patch16_224", img_size=32, num_classes=5, **TINY_VIT).eval()
    export_onnx(v, tmp_path / "v.onnx")
    with pytest.raises(ValueError, match="H and W multiples of 8"):
        OnnxModel(tmp_path / "v.onnx")(np.zeros((1, 3, 36, 32), np.float32))
    seq = vitkit.create_model("transformer_tiny")
    with pytest.raises(ExportError, match="transformer_tiny is a seq2seq model"):
        export_onnx(seq, tmp_path / "s.onnx")
    with pytest.raises(ValueError, match="opset must be 18 or newer"):
        export_onnx(v, tmp_path / "o.onnx", opset=17)


def test_export_then_predict_onnx_prints_the_pytorch_top_k(tmp_path, capsys):
    from PIL import Image

    from vitkit.checkpoints import save_pretrained
    from vitkit.cli import main

    m = vitkit.create_model("vit_small_patch16_224", img_size=32, num_classes=3, **TINY_VIT).eval()
    save_pretrained(m, tmp_path / "ckpt", class_names=["cat", "dog", "owl"])
    images = []
    for i, colour in enumerate([(200, 30, 30), (20, 180, 60), (90, 90, 240)]):
        images.append(str(tmp_path / f"{i}.png"))
        Image.new("RGB", (50, 40), colour).save(images[-1])
    assert main(["export", str(tmp_path / "ckpt"), "-o", str(tmp_path / "m.onnx")]) == 0
    out = capsys.readouterr().out
    assert "max |diff| against PyTorch" in out and "dynamic: batch, height, width" in out
    assert main(["predict", *images, "--onnx", str(tmp_path / "m.onnx"), "--topk", "3"]) == 0
    onnx_lines = capsys.readouterr().out
    assert main(["predict", *images, "--checkpoint", str(tmp_path / "ckpt"), "--topk", "3"]) == 0
    assert onnx_lines == capsys.readouterr().out and "cat" in onnx_lines
    assert main(["export", str(tmp_path / "ckpt"), "--format", "torch-export", "-o", str(tmp_path / "m.pt2")]) == 0
    assert (tmp_path / "m.pt2").exists()
    assert re.search("neither a file nor a model vitkit knows",
                     error_line_of(["export", "no_such_model", "-o", str(tmp_path / "x.onnx")]))


@pytest.mark.parametrize("image_size", [(50, 40), (40, 50), (224, 224), (17, 300), (640, 481)])
@pytest.mark.parametrize("size, crop_pct, interpolation, crop_mode", [
    ((32, 32), 0.875, "bicubic", "center"), ((224, 224), 1.0, "bilinear", "center"),
    ((48, 64), 0.9, "bicubic", "center"), ((98, 98), 0.875, "nearest", "center"),
    ((28, 56), 0.875, "bicubic", "squash"), ((32, 32), 0.9, "bilinear", "squash")])
def test_the_onnx_preprocessing_without_torch_is_the_eval_transform(image_size, size, crop_pct, interpolation,
                                                                    crop_mode):
    """OnnxModel.preprocess (PIL and numpy) gives what vitkit's eval transform (timm's, in torchvision) gives."""
    from types import SimpleNamespace

    from PIL import Image

    from vitkit.data.transforms import eval_transform
    from vitkit.deploy.onnx_model import OnnxModel

    rng = np.random.default_rng(sum(image_size))
    image = Image.fromarray(rng.integers(0, 256, (*image_size[::-1], 3), dtype=np.uint8))
    meta = dict(input_size=[3, *size], mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225], crop_pct=crop_pct,
                interpolation=interpolation, crop_mode=crop_mode)
    model = OnnxModel.__new__(OnnxModel)  # the preprocessing alone: no session
    model.path, model.meta = "m.onnx", meta
    cfg = SimpleNamespace(img_size=size, in_chans=3, mean=tuple(meta["mean"]), std=tuple(meta["std"]),
                          crop_pct=crop_pct, interpolation=interpolation, crop_mode=crop_mode)
    expected = eval_transform(cfg)(image)[None].numpy()
    got = model.preprocess(image)
    assert got.dtype == np.float32 and got.shape == expected.shape
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)


def test_predict_onnx_imports_neither_torch_nor_lightning(tmp_path):
    """`vitkit predict --onnx` in a fresh interpreter: the export runs in onnxruntime on numpy arrays."""
    from PIL import Image

    from vitkit.deploy.export import export_onnx

    m = vitkit.create_model("vit_small_patch16_224", img_size=32, num_classes=3, **TINY_VIT).eval()
    export_onnx(m, tmp_path / "m.onnx")
    Image.new("RGB", (50, 40), (200, 30, 30)).save(tmp_path / "a.png")
    (tmp_path / "folder/inner").mkdir(parents=True)  # a folder stands for its images, at every depth
    Image.new("RGB", (30, 40), (20, 30, 200)).save(tmp_path / "folder/inner/b.jpg")
    (tmp_path / "folder/notes.txt").write_text("not an image")
    code = ("import sys; from vitkit.cli import main; status = main(sys.argv[1:]); "
            "print(sorted(m for m in ('torch', 'lightning', 'timm', 'torchvision') if m in sys.modules)); "
            "sys.exit(status)")
    done = subprocess.run([sys.executable, "-c", code, "predict", str(tmp_path / "a.png"), str(tmp_path / "folder"),
                           "--onnx", str(tmp_path / "m.onnx")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0].startswith(f"{tmp_path / 'a.png'}: ") and lines[-1] == "[]", done.stdout
    assert len(lines) == 3 and lines[1].startswith(f"{tmp_path / 'folder/inner/b.jpg'}: "), done.stdout
    (tmp_path / "empty").mkdir()
    assert "empty is a folder without images (.jpg" in error_line_of(["predict", str(tmp_path / "empty"), "--onnx",
                                                                      str(tmp_path / "m.onnx")])


def test_onnxruntime_peer_in_the_benchmark_runs_vitkits_export():
    from vitkit.benchmarking.bench import OnnxRuntimeModule

    ort_net = OnnxRuntimeModule("vit_tiny_patch16_224", depth=1, img_size=64)
    x = torch.randn(2, 3, 64, 64)
    assert ort_net(x).shape == (2, 1000)
