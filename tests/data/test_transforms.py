"""Train / eval transforms: timm's pipelines, and they survive every RandAugment magnitude."""

import numpy as np
import torch
from PIL import Image

from vitkit import get_config
from vitkit.data.transforms import eval_transform, train_transform


def test_randaugment_at_full_magnitude_runs_with_current_pillow():
    cfg = get_config("vit_tiny_patch16_224", img_size=32)
    tf = train_transform(cfg, auto_augment="rand-m10-n3-inc1")  # posterize at magnitude 10 keeps 0 bits in timm
    img = Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 40, 3), dtype=np.uint8))
    for _ in range(300):
        x = tf(img)
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32


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
