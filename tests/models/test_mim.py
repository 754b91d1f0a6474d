"""Masked image modeling: MAE and SimMIM give transformers' losses, predictions and masks on the same weights;
Meta's and transformers' files load; the encoder is the preset's ViT / Swin; bad settings are named."""

import pytest
import timm
import torch
from torch.testing import assert_close

import vitkit
from vitkit.checkpoints import CheckpointError
from vitkit.models.mim import MAEConfig, MaskedAutoencoder, SimMIM, SimMIMConfig, patchify, unpatchify

TINY_VIT = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2)
TINY_SWIN = dict(img_size=32, patch_size=4, embed_dim=16, depths=(2, 2), num_heads=(1, 2), window_size=4)


def _randomize(model: torch.nn.Module) -> torch.nn.Module:
    """Random values everywhere (libraries init norms and the mask token to constants that hide mistakes); the
    fixed sin-cos positions a model holds as parameters too, as a file can."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def _hf_mae(norm_pix_loss: bool):
    from transformers import ViTMAEConfig, ViTMAEForPreTraining

    cfg = ViTMAEConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, image_size=32,
                       patch_size=8, decoder_hidden_size=16, decoder_num_hidden_layers=2,
                       decoder_num_attention_heads=2, decoder_intermediate_size=40, mask_ratio=0.75,
                       norm_pix_loss=norm_pix_loss, layer_norm_eps=1e-6)
    return _randomize(ViTMAEForPreTraining(cfg))


@pytest.mark.parametrize("norm_pix_loss", [True, False], ids=["norm_pix", "raw_pix"])
def test_mae_gives_transformers_loss_prediction_and_mask(norm_pix_loss, tmp_path):
    """transformers' ViTMAEForPreTraining saved in its format, read by vitkit with its decoder: given the same noise,
    the same loss, reconstructed patches and mask, within 1e-5."""
    theirs = _hf_mae(norm_pix_loss)
    theirs.save_pretrained(tmp_path / "hf_mae")
    ours = vitkit.create_mim(checkpoint=tmp_path / "hf_mae").eval()
    assert isinstance(ours, MaskedAutoencoder) and ours.cfg.norm_pix_loss == norm_pix_loss
    assert (ours.cfg.decoder_embed_dim, ours.cfg.decoder_depth, ours.cfg.decoder_num_heads) == (16, 2, 2)
    g = torch.Generator().manual_seed(1)
    x, noise = torch.randn(3, 3, 32, 32, generator=g), torch.rand(3, 16, generator=g)
    with torch.no_grad():
        ref = theirs(pixel_values=x, noise=noise)
        out = ours(x, noise=noise)
    assert_close(out.mask, ref.mask, atol=0, rtol=0)
    assert_close(out.pred, ref.logits, atol=1e-5, rtol=1e-5)
    assert_close(out.loss, ref.loss, atol=1e-5, rtol=1e-5)
    assert out.mask.sum(1).tolist() == [12, 12, 12]  # 0.75 of 16 hidden, per sample


def test_meta_mae_files_load_with_and_without_their_decoder(tmp_path):
    """Meta's mae_visualize_* (encoder and decoder, timm's names beside decoder_*) and mae_pretrain_* (the encoder
    alone, in {"model": ...}), made from a transformers model of the same weights: the first gives its loss, the
    second the encoder (a fresh decoder), and both are a ViT for create_model."""
    theirs = _hf_mae(True)
    theirs.save_pretrained(tmp_path / "hf")
    ours = vitkit.create_mim(checkpoint=tmp_path / "hf").eval()
    meta = {k.removeprefix("encoder."): v for k, v in ours.state_dict().items()}  # Meta's names: timm's + decoder_*
    torch.save({"model": meta}, tmp_path / "mae_visualize_vit_tiny.pth")
    torch.save({"model": {k: v for k, v in meta.items() if not k.startswith(("decoder", "mask_token"))}},
               tmp_path / "mae_pretrain_vit_tiny.pth")
    g = torch.Generator().manual_seed(2)
    x, noise = torch.randn(2, 3, 32, 32, generator=g), torch.rand(2, 16, generator=g)
    mim = dict(decoder_embed_dim=16, decoder_depth=2, decoder_num_heads=2, decoder_mlp_ratio=40 / 16)
    with torch.no_grad():
        ref = theirs(pixel_values=x, noise=noise).loss
        full = vitkit.create_mim("vit_tiny_patch16_224", checkpoint=tmp_path / "mae_visualize_vit_tiny.pth",
                                 mim=mim, **TINY_VIT, norm_eps=1e-6).eval()
        assert_close(full(x, noise=noise).loss, ref, atol=1e-5, rtol=1e-5)
    encoder_only = vitkit.create_mim("vit_tiny_patch16_224", checkpoint=tmp_path / "mae_pretrain_vit_tiny.pth",
                                     mim=mim, **TINY_VIT, norm_eps=1e-6)
    assert not hasattr(encoder_only, "heads_report")
    for k, v in ours.encoder.state_dict().items():
        assert torch.equal(encoder_only.encoder.state_dict()[k], v), k
    with torch.no_grad():
        features = ours.encoder.forward_features(x)
        for file in ("mae_visualize_vit_tiny.pth", "mae_pretrain_vit_tiny.pth", "hf"):
            vit = vitkit.create_model("vit_tiny_patch16_224", checkpoint=tmp_path / file, **TINY_VIT, norm_eps=1e-6)
            assert vit.load_report.ok and vit.num_classes == 0, vit.load_report
            assert_close(vit.eval().forward_features(x), features)
    model = theirs.vit  # transformers' ViTMAEModel, the encoder alone in its own folder
    model.save_pretrained(tmp_path / "hf_encoder")
    vit = vitkit.create_model(checkpoint=tmp_path / "hf_encoder")
    assert vit.load_report.ok and vit.name == "vit_base_patch16_224" and vit.cfg.embed_dim == 32


def test_the_encoder_sees_the_kept_patches_with_their_positions_and_rope_rows():
    """``embed_tokens(keep=...)``: the prefix tokens and the kept patches with their own positions, and RoPE rows;
    encoding only the kept tokens equals picking them out of a run where every other token is masked out."""
    torch.manual_seed(0)
    for overrides in (dict(), dict(reg_tokens=2), dict(pos_embed="sincos"), dict(rope="axial", pos_embed="none"),
                      dict(rope="mixed", pos_embed="none")):
        vit = vitkit.create_model("vit_tiny_patch16_224", **TINY_VIT, num_classes=0, **overrides).eval()
        x = torch.randn(2, 3, 32, 32)
        keep = torch.stack([torch.tensor([3, 0, 9, 14]), torch.tensor([15, 1, 2, 8])])
        patches, grid = vit.embed_patches(x)
        full, rope_full = vit.embed_tokens(patches, grid)
        kept, rope = vit.embed_tokens(patches, grid, keep)
        P = vit.num_prefix_tokens
        assert_close(kept[:, P:], full[:, P:].gather(1, keep[..., None].expand(-1, -1, 32)))
        assert_close(kept[:, :P], full[:, :P])
        if rope is not None:
            rows = torch.cat([torch.arange(P).expand(2, -1), keep + P], 1)
            table = rope_full[0] if rope_full[0].dim() == 2 else rope_full[0][0, 0]
            picked = rope[0][:, 0] if rope[0].dim() == 4 else rope[0][0, :, 0]
            assert_close(picked, table[rows])
        with torch.no_grad():
            assert vit.forward_blocks(kept, rope).shape == (2, P + 4, 32)


def test_patchify_orders_pixels_as_meta_does_and_unpatchify_inverts_it():
    x = torch.randn(2, 3, 16, 24)
    p = patchify(x, 8)
    assert p.shape == (2, 6, 192)
    assert_close(p[0, 1].view(8, 8, 3), x[0, :, 0:8, 8:16].permute(1, 2, 0))  # row, column, channel
    assert_close(unpatchify(p, 8, (2, 3)), x)


@pytest.mark.parametrize("family", ["swin", "vit"])
def test_simmim_gives_transformers_loss_and_reconstruction(family, tmp_path):
    """transformers' Swin/ViTForMaskedImageModeling saved in its format: the same bool_masked_pos gives the same
    loss and reconstruction, within 1e-5."""
    from transformers import SwinConfig, SwinForMaskedImageModeling, ViTConfig, ViTForMaskedImageModeling

    if family == "swin":
        theirs = SwinForMaskedImageModeling(SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[2, 2],
                                                       num_heads=[1, 2], window_size=4, encoder_stride=8))
        grid = 8
    else:
        theirs = ViTForMaskedImageModeling(ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                     intermediate_size=64, image_size=32, patch_size=8,
                                                     encoder_stride=8))
        grid = 4
    _randomize(theirs).save_pretrained(tmp_path / "hf")
    ours = vitkit.create_mim(checkpoint=tmp_path / "hf", objective="simmim", mim=dict(mask_patch_size=8)).eval()
    assert isinstance(ours, SimMIM) and ours.heads_report.ok
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 32, 32, generator=g)
    mask = torch.rand(2, grid * grid, generator=g) > 0.4
    with torch.no_grad():
        ref = theirs(pixel_values=x, bool_masked_pos=mask)
        out = ours(x, mask)
    assert_close(out.pred, ref.reconstruction, atol=1e-5, rtol=1e-5)
    assert_close(out.loss, ref.loss, atol=1e-5, rtol=1e-5)


def test_simmim_masks_blocks_of_mask_patch_size_at_its_ratio():
    model = SimMIM(SimMIMConfig("swin_tiny_patch4_window7_224", TINY_SWIN, mask_ratio=0.6, mask_patch_size=16))
    mask = model.random_mask(5, (32, 32), torch.device("cpu"))  # a 2x2 grid of 16 px blocks, 4x4 patches each
    assert mask.shape == (5, 64)
    blocks = mask.view(5, 2, 4, 2, 4)
    assert (blocks.all(dim=(2, 4)) | ~blocks.any(dim=(2, 4))).all()  # each block wholly hidden or wholly kept
    assert blocks.all(dim=(2, 4)).sum(dim=(1, 2)).tolist() == [3] * 5  # ceil(0.6 x 4)


def test_the_encoder_is_the_presets_model_and_fine_tunes_as_a_backbone(tmp_path):
    mae = MaskedAutoencoder(MAEConfig("vit_tiny_patch16_224", TINY_VIT, decoder_embed_dim=16, decoder_depth=1,
                                      decoder_num_heads=2))
    timm_vit = timm.create_model("vit_tiny_patch16_224", num_classes=0, **TINY_VIT)
    timm_vit.load_state_dict(mae.encoder.state_dict(), strict=True)  # timm's names, no conversion
    torch.save(mae.state_dict(), tmp_path / "mae.pth")
    tuned = vitkit.create_model("vit_tiny_patch16_224", checkpoint=tmp_path / "mae.pth", num_classes=5, **TINY_VIT)
    assert tuned.load_report.ok and tuned.load_report.new_head == ["head.bias", "head.weight"]


@pytest.mark.parametrize("bad, message", [
    (dict(mask_ratio=1.0), r"mask_ratio must be in \(0, 1\)"),
    (dict(mask_ratio=0.0), r"mask_ratio must be in \(0, 1\)"),
    (dict(decoder_embed_dim=30, decoder_num_heads=4), "decoder_embed_dim 30 must be divisible by decoder_num_heads 4"),
])
def test_bad_mae_settings_are_named(bad, message):
    with pytest.raises(ValueError, match=message):
        MAEConfig("vit_tiny_patch16_224", TINY_VIT, **bad)


def test_bad_input_is_named(tmp_path):
    with pytest.raises(ValueError, match="pre-train Swin with SimMIM"):
        vitkit.create_mim("swin_tiny_patch4_window7_224", objective="mae", **TINY_SWIN)
    mae = vitkit.create_mim("vit_tiny_patch16_224", mim=dict(decoder_embed_dim=16, decoder_depth=1,
                                                             decoder_num_heads=2), **TINY_VIT)
    with pytest.raises(ValueError, match=r"VisionTransformer expects images of shape \(B, 3, 32, 32\)"):
        mae(torch.randn(1, 3, 16, 16))
    simmim = vitkit.create_mim("swin_tiny_patch4_window7_224", mim=dict(mask_patch_size=16), **TINY_SWIN)
    with pytest.raises(ValueError, match=r"multiples of the mask block \(mask_patch_size\) \(16 px\), at least one; "
                                         r"got 8x8"):
        simmim(torch.randn(1, 3, 8, 8))
    with pytest.raises(ValueError, match="mask_patch_size 6 must be a multiple of the encoder's patch size 4"):
        vitkit.create_mim("swin_tiny_patch4_window7_224", mim=dict(mask_patch_size=6), **TINY_SWIN)
    swin_file = vitkit.save_pretrained(vitkit.create_model("swin_tiny_patch4_window7_224", **TINY_SWIN, num_classes=0),
                                       tmp_path / "swin_backbone")
    with pytest.raises(CheckpointError, match="does not fit the model"):
        vitkit.create_mim("vit_tiny_patch16_224", checkpoint=swin_file, **TINY_VIT)


@pytest.mark.parametrize("channels,size,title", [(3, 32, "epoch 3: val loss 0.123"), (1, 20, "a title"), (3, 224, "")],
                         ids=["rgb_digits", "grey_wide_title", "photo_size_untitled"])
def test_the_reconstruction_grid_holds_each_image_exactly_in_its_row_and_column(channels, size, title, tmp_path):
    """The picture a pre-training run draws every epoch: originals, masked inputs and reconstructions in rows of
    cells ``GRID_GAP`` apart at the bottom right, each image scaled by ``cell_scale`` (nearest neighbour), its
    pixels exact."""
    import numpy as np
    from PIL import Image

    from vitkit.evaluation.plots import GRID_GAP, cell_scale, reconstruction_grid

    g = torch.Generator().manual_seed(0)
    rows = [torch.rand(3, channels, size, size, generator=g) for _ in range(3)]
    title = title and title * (4 if size == 20 else 1)  # wider than the cells too
    with Image.open(reconstruction_grid(*rows, tmp_path / "sub" / "grid.png", title)) as im:
        assert im.format == "PNG" and im.mode == "RGB"
        picture = np.asarray(im)
    s = cell_scale(size, size)
    assert s == (5 if size == 20 else 3 if size == 32 else 1) and size * s >= 96
    step = size * s + GRID_GAP
    top, left = picture.shape[0] - 3 * step, picture.shape[1] - 3 * step
    assert top >= (20 if title else GRID_GAP) and left >= 60  # room for the title and the row names
    for r, images in enumerate(rows):
        for i, image in enumerate(images):
            expected = (image * 255).round().to(torch.uint8).expand(3, -1, -1)
            expected = expected.repeat_interleave(s, 1).repeat_interleave(s, 2).permute(1, 2, 0).numpy()
            cell = picture[top + r * step:top + r * step + size * s, left + i * step:left + i * step + size * s]
            assert np.array_equal(cell, expected), (r, i)
    assert (picture[:top] == 255).all() == (not title)  # the title is written above the cells


def test_mae_on_packed_images_gives_each_image_its_own_prediction_and_loss():
    """Images of three shapes packed: each image keeps a quarter of its patches (drawn by the generator), and its
    prediction in the packed slots equals MAE run on that image alone with the same patches kept; the loss is the
    mean over every image's hidden patches."""
    from vitkit.models.packing import pack

    torch.manual_seed(0)
    cfg = MAEConfig(encoder="vit_tiny_patch16_224", encoder_overrides={**TINY_VIT, "num_classes": 0},
                    decoder_embed_dim=16, decoder_depth=1, decoder_num_heads=2)
    mae = MaskedAutoencoder(cfg).eval()
    mae.encoder.set_dynamic_img_size(True)
    images = [torch.randn(3, h, w) for h, w in ((32, 32), (16, 48), (32, 16), (16, 16))]  # 16, 12, 8 and 4 patches
    batch = pack(images, 8, 20, 1)
    with torch.no_grad():
        out = mae.forward_packed(batch, torch.Generator().manual_seed(3))
    visible = pack(batch.images(), 8, 20, 1, 0.75, torch.Generator().manual_seed(3))  # the draw inside
    losses, hidden_total = [], 0
    for i, image in enumerate(images):
        n = (image.shape[1] // 8) * (image.shape[2] // 8)
        kept = visible.index[(visible.image == i) & (visible.index >= 1)] - 1
        noise = torch.ones(1, n)
        noise[0, kept] = 0
        with torch.no_grad():
            alone = mae(image[None], noise)
        slots = (batch.image == i) & (batch.index >= 1)
        order = batch.index[slots].argsort()
        assert_close(out.pred[slots][order], alone.pred[0], atol=1e-5, rtol=1e-4)
        assert_close(out.mask[slots][order].float(), alone.mask[0])
        hidden = int(alone.mask.sum())
        losses.append(alone.loss * hidden)
        hidden_total += hidden
    assert_close(out.loss, sum(losses) / hidden_total, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="pack without token dropping"):
        mae.forward_packed(pack(images, 8, 20, 1, drop=0.5))
