"""``vitkit export --packed``: a ViT on packed batches in onnxruntime and as a .pt2 gives, image by image, the logits
of each image run alone through the PyTorch model, for packings of other lengths and image counts than the export
saw; the resize weights behind its positions are ``F.interpolate``'s; what cannot export so is refused in one line."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import vitkit
from vitkit.deploy.export import ExportError, OnnxModel
from vitkit.deploy.export_packed import export_packed
from vitkit.layers.resample import resample_weights
from vitkit.models.packing import pack

from .commands import error_line_of

pytest.importorskip("onnxruntime")

TINY_VIT = dict(depth=2, embed_dim=32, num_heads=2, patch_size=8)


@pytest.mark.parametrize("mode", ["bicubic", "bilinear"])
def test_resize_weights_are_those_of_the_antialiased_interpolate(mode):
    torch.manual_seed(0)
    for src in ((1, 3), (2, 5), (7, 7), (16, 9)):
        pos = torch.randn(1, *src, 24).permute(0, 3, 1, 2)  # (1, C, h, w), as positions are resized
        for dst in ((1, 1), (1, 4), (3, 1), (2, 2), (5, 12), (16, 9), (33, 20)):
            want = F.interpolate(pos, size=dst, mode=mode, antialias=True, align_corners=False)[0]
            rows, cols = torch.arange(dst[0]), torch.arange(dst[1])
            wy = resample_weights(rows, torch.full_like(rows, dst[0]), src[0], mode)  # (h', h)
            wx = resample_weights(cols, torch.full_like(cols, dst[1]), src[1], mode)  # (w', w)
            torch.testing.assert_close(torch.einsum("ia,jb,cab->cij", wy, wx, pos[0]), want, atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match="bilinear or bicubic"):
        resample_weights(rows, rows, 3, "nearest")


def _images(shapes, p: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, r * p, c * p, generator=g) for r, c in shapes]


def _alone(model, images) -> torch.Tensor:
    """Each image through the PyTorch model by itself (positions resampled to its grid)."""
    model.set_dynamic_img_size(True)
    with torch.no_grad():
        return torch.cat([model(x[None]) for x in images])


@pytest.mark.slow
@pytest.mark.parametrize("name, extra", [
    ("vit_small_patch16_224", dict(global_pool="map", pos_interp="bilinear")),
    ("vit_small_patch16_224", dict(no_embed_class=True, reg_tokens=2, global_pool="avgmax", pos_keep_aspect=True)),
])
def test_a_packed_onnx_export_gives_each_image_its_own_logits(name, extra, tmp_path):
    model = vitkit.create_model(name, img_size=(32, 48), num_classes=5, **TINY_VIT, **extra).eval()
    report = export_packed(model, tmp_path / "m.onnx")
    assert report.max_abs_diff < 1e-5 and report.dynamic == ["sequences", "slots", "images"]
    net = OnnxModel(tmp_path / "m.onnx")
    prefix = model.num_prefix_tokens
    assert net.packed and net.meta["prefix"] == prefix and net.meta["patch_size"] == 8 and net.meta["max_patches"] == 24
    # more images, of other shapes, in longer sequences than the export's checks: each image's logits as alone
    images = _images([(4, 6), (1, 9), (7, 2), (2, 2), (1, 1), (5, 5), (3, 8)], 8, seed=1)
    batch = pack(images, 8, 64, prefix)
    assert batch.patches.shape[0] >= 2 and (batch.image >= 0).sum(1).min() > 0
    grids = np.asarray(batch.grids, dtype=np.int64)
    got = net.run_packed(batch.patches.numpy(), batch.image.numpy(), batch.index.numpy(), grids)
    np.testing.assert_allclose(got, _alone(model, images).numpy(), atol=2e-5, rtol=0)
    # images of one size, each one sequence (what predict --onnx feeds it)
    x = torch.randn(3, 3, 40, 24)
    np.testing.assert_allclose(net(x.numpy()), _alone(model, list(x)).numpy(), atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match="multiples of 8"):
        net(np.zeros((1, 3, 30, 24), np.float32))
    with pytest.raises(ValueError, match=r"image and index \(S, L\) int64.*got .*image \(\d+, 64\) int32"):
        net.run_packed(batch.patches.numpy(), batch.image.int().numpy(), batch.index.numpy(), grids)
    with pytest.raises(ValueError, match="image ids below the number of grids"):
        net.run_packed(batch.patches.numpy(), batch.image.numpy(), batch.index.numpy(), grids[:2])
    bad = batch.index.numpy().copy()
    bad[0, -1 if batch.image[0, -1] >= 0 else 0] = 999  # a slot past its image's patches
    with pytest.raises(ValueError, match="each slot's index -1 for padding"):
        net.run_packed(batch.patches.numpy(), batch.image.numpy(), bad, grids)


@pytest.mark.slow
@pytest.mark.parametrize("name, extra", [
    ("vit_small_patch16_224", {}),
    ("vit_small_patch16_dinov3", {}),  # DINOv3's RoPE, 4 registers, no learned positions
    ("vit_base_patch16_rope_ape_224", dict(rope_xy=True, rope_ref_grid=3)),  # axial RoPE beside learned positions
])
def test_a_packed_program_runs_packings_it_did_not_see(name, extra, tmp_path):
    model = vitkit.create_model(name, img_size=32, num_classes=3, **TINY_VIT, **extra).eval()
    export_packed(model, tmp_path / "m.pt2", fmt="torch-export")
    program = torch.export.load(str(tmp_path / "m.pt2")).module()
    images = _images([(2, 7), (6, 1), (3, 3)], 8, seed=2)
    batch = pack(images, 8, 30, model.num_prefix_tokens)
    with torch.no_grad():
        got = program(batch.patches, batch.image, batch.index, torch.tensor(batch.grids).reshape(-1, 2))
    torch.testing.assert_close(got, _alone(model, images), atol=2e-5, rtol=0)


def test_what_cannot_export_packed_is_refused_in_one_line(tmp_path):
    swin = vitkit.create_model("swin_tiny_patch4_window7_224", img_size=32, num_classes=3, embed_dim=16,
                               depths=[1, 1], num_heads=[1, 2], window_size=2, patch_size=2)
    with pytest.raises(ExportError, match="Swin's windows"):
        export_packed(swin, tmp_path / "s.onnx")
    rope = vitkit.create_model("vit_base_patch16_rope_mixed_224", img_size=32, num_classes=3, **TINY_VIT)
    with pytest.raises(ExportError, match="learned per-block frequencies"):
        export_packed(rope, tmp_path / "r.onnx")
    assert not (tmp_path / "s.onnx").exists() and not (tmp_path / "r.onnx").exists()
    for flag in (["--int8", "--calibrate", str(tmp_path)], ["--fixed-size"], ["--token-merging", "2"]):
        assert f"without {flag[0]}" in error_line_of(["export", "vit_small_patch16_224", "--packed", *flag])
