"""Train / eval transforms: timm's pipelines, and they survive every RandAugment magnitude."""

import numpy as np
import torch
from PIL import Image

from vitkit import get_config
from vitkit.data.transforms import eval_transform, train_transform


def test_randaugment_at_full_magnitude_runs_with_current_pillow():
    """Center crops and squashed whole images alike (a multi-label image folder squashes)."""
    for mode in ("center", "squash"):
        cfg = get_config("vit_tiny_patch16_224", img_size=32, crop_mode=mode)
        tf = train_transform(cfg, auto_augment="rand-m10-n3-inc1")  # posterize at magnitude 10 keeps 0 bits in timm
        img = Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 40, 3), dtype=np.uint8))
        for _ in range(300):
            x = tf(img)
        assert x.shape == (3, 32, 32) and x.dtype == torch.float32, mode


def test_eval_transform_resizes_crops_and_normalises():
    cfg = get_config("vit_tiny_patch16_224", img_size=32)
    x = eval_transform(cfg)(Image.new("RGB", (50, 40), (255, 255, 255)))
    assert x.shape == (3, 32, 32)
    torch.testing.assert_close(x[:, 0, 0], (1 - torch.tensor(cfg.mean)) / torch.tensor(cfg.std))


def test_train_transform_pickles_for_spawned_loader_workers():
    """DataLoader workers started with spawn (macOS; litdata's optimize switches a process to it) pickle the
    dataset and its transform."""
    import pickle
    from types import SimpleNamespace

    cfg = SimpleNamespace(img_size=32, in_chans=3, mean=(0.5,) * 3, std=(0.5,) * 3)
    tf = pickle.loads(pickle.dumps(train_transform(cfg)))
    assert tf(Image.new("RGB", (40, 40), (10, 20, 30))).shape == (3, 32, 32)


def test_posterize_at_full_magnitude_keeps_one_bit():
    """Where timm's posterize would keep 0 bits (Pillow >= 11 refuses), the image keeps 1 bit per channel."""
    from vitkit.data.transforms import AtLeastOneBit

    cfg = get_config("vit_tiny_patch16_224", img_size=32)
    ra = next(t for t in train_transform(cfg, auto_augment="rand-m10-n1-inc1").transforms if hasattr(t, "ops"))
    posterize = [op for op in ra.ops if isinstance(op, AtLeastOneBit)]
    assert [op.op.name for op in posterize] == ["PosterizeIncreasing"]
    posterize[0].op.prob = 1.0
    img = Image.fromarray(np.random.default_rng(0).integers(0, 255, (16, 16, 3), dtype=np.uint8))
    assert set(np.unique(np.asarray(posterize[0](img)))) <= {0, 128}


def test_the_default_augmentation_suits_the_image_size_and_given_fields_win():
    """Left to the size (``"auto"``, or None where None is no value of the field): timm's ImageNet pipeline from
    64 px up; below, a crop of 80 % or more and no flip, RandAugment, jitter or erasing. A given value always wins,
    None included (off)."""
    from vitkit.data.transforms import IMAGENET_AUGMENT, SMALL_AUGMENT, default_augment

    assert default_augment(224) == IMAGENET_AUGMENT and default_augment((64, 96)) == IMAGENET_AUGMENT
    assert default_augment(28) == SMALL_AUGMENT == default_augment((32, 128))
    assert default_augment(28, hflip=0.5, auto_augment="rand-m5")["hflip"] == 0.5
    assert default_augment(28, auto_augment="rand-m5")["auto_augment"] == "rand-m5"
    assert default_augment(224, auto_augment=None, color_jitter=None)["auto_augment"] is None
    assert default_augment(224, color_jitter=None)["color_jitter"] is None
    assert default_augment(224, scale=(0.5, 1.0), re_prob=None)["scale"] == (0.5, 1.0)


def _photos(n: int = 12) -> list[Image.Image]:
    from sklearn.datasets import load_sample_images

    photos = load_sample_images().images  # two real photos (427 x 640) that ship with scikit-learn
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):  # crops of several sizes
        h, w = rng.integers(60, 300, size=2)
        y, x = rng.integers(0, 427 - 300), rng.integers(0, 640 - 300)
        out.append(Image.fromarray(photos[i % 2][y:y + h, x:x + w]))
    return out


def test_the_uint8_pipeline_gives_the_float_pipelines_pixels_once_normalised_on_the_device():
    """RandomResizedCrop, flip and RandAugment in the worker up to uint8, then ``device_batch``: the same random
    draws, and the pixels ToTensor and Normalize give, within float rounding."""
    import random

    from vitkit.data.transforms import device_batch

    cfg = get_config("vit_base_patch16_clip_224")  # a mean and std other than ImageNet's
    cfg.img_size, cfg.in_chans = 64, 3
    aug = dict(auto_augment="rand-m9-mstd0.5-inc1", re_prob=0.0, scale=(0.08, 1.0), hflip=0.5, color_jitter=0.4)
    photos = _photos()
    batches = []
    for on_device in (False, True):
        random.seed(0), np.random.seed(0), torch.manual_seed(0)  # RandAugment draws from all three
        tf = train_transform(cfg, **aug, on_device=on_device)
        batches.append(torch.stack([tf(p) for p in photos]))
    floats, raw = batches
    assert raw.dtype == torch.uint8 and floats.dtype == torch.float32 and raw.shape == floats.shape == (12, 3, 64, 64)
    torch.testing.assert_close(device_batch(raw, cfg), floats, atol=1e-5, rtol=1e-5)


def test_random_erasing_on_the_device_erases_a_share_of_images_with_noise():
    from vitkit.data.transforms import device_batch

    cfg = get_config("vit_base_patch16_224")
    x = torch.full((400, 3, 32, 32), 128, dtype=torch.uint8)
    torch.manual_seed(0)
    import random

    random.seed(0)
    out = device_batch(x, cfg, re_prob=0.25)
    plain = device_batch(x[:1], cfg)[0]
    erased = [not torch.equal(o, plain) for o in out]
    assert 0.15 < sum(erased) / len(erased) < 0.35, sum(erased)
    box = (out[erased.index(True)] - plain).abs().sum(0) > 0  # one rectangle of per-pixel noise
    rows, cols = box.any(1).nonzero().flatten(), box.any(0).nonzero().flatten()
    assert box[rows[0]:rows[-1] + 1, cols[0]:cols[-1] + 1].all()
    assert torch.equal(device_batch(x, cfg, re_prob=0.0), plain.expand_as(out))


def test_a_16_bit_image_is_read_as_its_8_bit_values_by_every_reader(tmp_path):
    """A 16-bit grey PNG holds the values of its 8-bit twin times 257: the training reader, vitkit predict's reader and
    the segmentation reader all give the twin's pixels (Pillow's convert("RGB") alone clips them to 255)."""
    import io

    from vitkit.cli.predict import read_image
    from vitkit.data.folder import decode
    from vitkit.data.segmentation import _uint8

    grey = np.random.default_rng(0).integers(0, 256, size=(12, 20), dtype=np.uint8)
    Image.fromarray(grey.astype(np.uint16) * 257).save(tmp_path / "sixteen.png")
    assert Image.open(tmp_path / "sixteen.png").mode.startswith("I")
    twin = np.repeat(grey[..., None], 3, axis=2)
    assert np.array_equal(np.asarray(decode((tmp_path / "sixteen.png").read_bytes())), twin)
    assert np.array_equal(np.asarray(read_image(str(tmp_path / "sixteen.png")).convert("RGB")), twin)
    assert np.array_equal(_uint8(Image.open(tmp_path / "sixteen.png")).permute(1, 2, 0).numpy(), twin)
    clipped = np.asarray(Image.open(io.BytesIO((tmp_path / "sixteen.png").read_bytes())).convert("RGB"))
    assert (clipped[grey > 0] == 255).all()  # what the readers mend: Pillow alone whitens every non-zero pixel
