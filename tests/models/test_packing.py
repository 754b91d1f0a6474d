"""Images of their own sizes packed into sequences on the one attention core: image by image the logits (and the
gradients) of each image run alone, on every backend the core has on CPU without a compiler, for each way a ViT
pools and places its positions; bad budgets and models that cannot pack end in one line."""

import pytest
import torch

import vitkit
from vitkit.models.packing import budget_size, pack

SIZES = [(32, 32), (16, 40), (8, 8), (24, 12), (40, 20), (4, 64)]  # in 4 px patches: 64, 40, 4, 18, 50, 16


def _vit(**overrides):
    torch.manual_seed(0)
    cfg = dict(num_classes=5, img_size=32, patch_size=4, embed_dim=48, depth=2, num_heads=3, dynamic_img_size=True)
    return vitkit.create_model("vit_tiny_patch16_224", **{**cfg, **overrides}).eval()


def _images():
    g = torch.Generator().manual_seed(0)
    return [torch.rand(3, h, w, generator=g) for h, w in SIZES]


@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize("overrides", [
    {}, {"global_pool": "avg"}, {"reg_tokens": 2, "no_embed_class": True}, {"global_pool": "max", "rope": "axial"},
    {"global_pool": "avgmax", "rope": "dinov3", "pos_embed": "none"}, {"class_token": False, "global_pool": "avg"},
    {"global_pool": "map", "reg_tokens": 1},
], ids=["token", "avg", "registers", "axial_rope", "dinov3_rope", "no_class_token", "map"])
def test_a_packed_batch_gives_each_images_own_logits(backend, overrides):
    model = _vit(**overrides)
    model.set_attn_backend(backend)
    images = _images()
    batch = pack(images, 4, 160, model.num_prefix_tokens)
    assert batch.patches.shape[0] < len(images)  # several images share a sequence
    with torch.no_grad():
        packed = model.forward_packed(batch)
        alone = torch.cat([model(img[None]) for img in images])
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


def test_packed_training_gives_the_gradients_of_the_images_run_alone():
    model = _vit(global_pool="avg", drop_path_rate=0.0)
    images, targets = _images(), torch.arange(len(SIZES)) % 5
    torch.nn.functional.cross_entropy(model.forward_packed(pack(images, 4, 128)), targets, reduction="sum").backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    sum(torch.nn.functional.cross_entropy(model(img[None]), t[None]) for img, t in zip(images, targets, strict=True)) \
        .backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(packed[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_packing_fills_sequences_first_fit_largest_first():
    batch = pack(_images(), 4, 70)  # tokens with the class token: 65, 41, 5, 19, 51, 17
    assert batch.patches.shape[:2] == (3, 70)  # 65 + 5, 51 + 19, 41 + 17: 198 of 210 slots
    assert [sorted(set(row[row >= 0].tolist())) for row in batch.image] == [[0, 2], [3, 4], [1, 5]]
    assert batch.padding == pytest.approx(1 - 198 / 210)
    for i, (h, w) in enumerate(SIZES):  # each image's slots: its prefix, then its patches row by row
        assert (batch.index[batch.image == i] == torch.arange(1 + h * w // 16)).all()


def test_the_budget_resizes_as_timms_naflex_loader_does():
    from timm.data.naflex_transforms import get_image_size_for_seq

    for (h, w), patches in [((480, 640), 256), ((100, 1000), 64), ((224, 224), 196), ((37, 53), 9), ((2000, 30), 576),
                            ((16, 16), 1024)]:
        assert budget_size(h, w, 16, patches) == tuple(get_image_size_for_seq((h, w), 16, patches)[1]), (h, w)
        rows, cols = (s // 16 for s in budget_size(h, w, 16, patches))
        assert rows * cols <= patches


def test_bad_budgets_and_models_that_cannot_pack_end_in_one_line():
    with pytest.raises(ValueError, match=r"max_tokens 40 is smaller than image 0's 65 tokens \(\(32, 32\) in 4 px "
                                         r"patches, with 1 prefix\); give at least 65"):
        pack(_images(), 4, 40)
    with pytest.raises(ValueError, match=r"image 0: expected \(C, H, W\) with H and W multiples of the patch size 4"):
        pack([torch.rand(3, 30, 32)], 4, 100)
    with pytest.raises(ValueError, match=r"image 1: expected .* and image 0's 3 channels, got \(1, 8, 8\)"):
        pack([torch.rand(3, 8, 8), torch.rand(1, 8, 8)], 4, 100)
    with pytest.raises(ValueError, match="packed with 1 prefix token.s.; .* has 3: pack with prefix=3"):
        _vit(reg_tokens=2).forward_packed(pack(_images(), 4, 160))
    with pytest.raises(ValueError, match="packed batches pool by the class token, avg, max, avgmax or map; not "
                                         "distilled heads"):
        model = _vit(distilled=True)
        model.forward_packed(pack(_images(), 4, 160, model.num_prefix_tokens))
    with pytest.raises(ValueError, match=r"learned per-block frequencies \(rope 'mixed'\) are not packed"):
        _vit(rope="mixed").forward_packed(pack(_images(), 4, 160))


def test_a_loader_collates_images_of_their_own_shapes_into_packed_batches():
    """``PackCollate`` in a DataLoader: each image resized to its patch budget at its aspect ratio, packed; the model
    gives each the logits of that resized image alone, with its label beside it."""
    from torch.utils.data import DataLoader

    from vitkit.models.packing import PackCollate

    g = torch.Generator().manual_seed(0)
    samples = [(torch.rand(3, h, w, generator=g), i % 5) for i, (h, w) in enumerate([(60, 200), (90, 30), (48, 48),
                                                                                        (100, 70), (17, 33)])]
    model = _vit(global_pool="avg")
    collate = PackCollate(4, 100, 36, model.num_prefix_tokens)
    batches = list(DataLoader(samples, batch_size=3, collate_fn=collate))
    assert [len(labels) for _, labels in batches] == [3, 2]
    logits = torch.cat([model.forward_packed(batch) for batch, _ in batches]).detach()
    resized = [collate.resize(img) for img, _ in samples]
    assert all(img.shape[-2] * img.shape[-1] // 16 <= 36 for img in resized)
    assert resized[0].shape[-1] > 2 * resized[0].shape[-2]  # the wide one stays wide
    with torch.no_grad():
        alone = torch.cat([model(img[None]) for img in resized])
    torch.testing.assert_close(logits, alone, rtol=1e-5, atol=1e-5)
    assert torch.cat([labels for _, labels in batches]).tolist() == [label for _, label in samples]
    with pytest.raises(ValueError, match=r"max_tokens 30 is smaller than one image's 36 patches and 1 prefix"):
        PackCollate(4, 30, 36)


def test_a_packed_batch_runs_under_bf16_autocast_as_the_images_alone():
    """bf16-mixed training and evaluation: the packed tokens take the dtype autocast gives the patch projection."""
    model = _vit(reg_tokens=1, global_pool="map")
    images = _images()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        packed = model.forward_packed(pack(images, 4, 160, model.num_prefix_tokens)).float()
        alone = torch.cat([model(img[None]) for img in images]).float()
    torch.testing.assert_close(packed, alone, rtol=0.05, atol=0.05)


def test_token_dropping_gives_each_image_the_logits_of_its_kept_patches_alone():
    """NaViT's token dropping: each image keeps half its patches at random (one at least), in their own places."""
    model = _vit(global_pool="avg", reg_tokens=1, rope="axial")
    images = _images()
    batch = pack(images, 4, 160, model.num_prefix_tokens, drop=0.5, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        packed = model.forward_packed(batch)
        for i, img in enumerate(images):
            keep = batch.index[(batch.image == i) & (batch.index >= batch.prefix)] - batch.prefix
            rows, cols = batch.grids[i]
            assert len(keep) == max(1, round(rows * cols / 2)) and len(set(keep.tolist())) == len(keep)
            patches, grid = model.embed_patches(img[None])
            x, rope = model.embed_tokens(patches, grid, keep=keep[None])
            torch.testing.assert_close(packed[i], model.forward_head(model.forward_blocks(x, rope))[0], rtol=1e-5,
                                       atol=1e-5)
    with pytest.raises(ValueError, match=r"drop is the share of each image's patches left out, in \[0, 1\); got 1"):
        pack(images, 4, 160, drop=1.0)
