"""DINO's multi-crop on the device: each operation equals torchvision's on the same draws (crop geometry, flip,
blur, brightness, contrast, saturation, solarisation), and the crops come out in the shapes and value range asked."""

import pytest
import torch
import torchvision.transforms.v2.functional as TF
from sklearn.datasets import load_sample_images
from torch.testing import assert_close

from vitkit.data.multicrop import (
    MultiCrop,
    _brightness,
    _contrast,
    _hue,
    _saturation,
    gaussian_blur,
    resized_crops,
    solarize,
)


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    """The two real photos that ship with scikit-learn (a temple, a flower), 64 x 64, in [0, 1]."""
    x = [torch.from_numpy(p.copy()).permute(2, 0, 1).float()[None] / 255 for p in load_sample_images().images]
    return torch.cat([torch.nn.functional.interpolate(i, size=(64, 64), mode="area") for i in x])


def test_a_whole_image_crop_is_the_image_and_a_flip_its_mirror(images):
    same = resized_crops(images, 64, (1.0, 1.0), flip=0.0, ratio=(1.0, 1.0))
    assert_close(same, images, atol=1e-5, rtol=0)
    assert_close(resized_crops(images, 64, (1.0, 1.0), flip=1.0, ratio=(1.0, 1.0)), images.flip(-1), atol=1e-5, rtol=0)
    half = resized_crops(images, 32, (1.0, 1.0), flip=0.0, ratio=(1.0, 1.0))  # bilinear at half the size
    assert_close(half, TF.resize(images, [32, 32], antialias=False), atol=1e-5, rtol=0)


def test_a_crop_is_a_rectangle_of_the_share_and_shape_asked():
    """On an image whose channels are its pixel coordinates, a crop shows which rectangle it took: bilinear
    resampling of a linear ramp is exact."""
    H, W = 60, 80
    ys, xs = torch.meshgrid(torch.arange(H) + 0.5, torch.arange(W) + 0.5, indexing="ij")
    ramp = torch.stack([xs, ys, xs * 0]).expand(64, 3, H, W)
    crops = resized_crops(ramp, 24, (0.1, 0.4), flip=0.5, generator=torch.Generator().manual_seed(0))
    x, y = crops[:, 0], crops[:, 1]
    step_x, step_y = x[:, :, 1:] - x[:, :, :-1], y[:, 1:] - y[:, :-1]
    assert_close(step_x, step_x[:, :1, :1].expand_as(step_x), atol=1e-3, rtol=0)  # an axis-aligned rectangle,
    assert_close(step_y, step_y[:, :1, :1].expand_as(step_y), atol=1e-3, rtol=0)  # evenly sampled
    width, height = step_x[:, 0, 0].abs() * 24, step_y[:, 0, 0] * 24
    share, aspect = width * height / (H * W), width / height
    assert ((share > 0.1 - 1e-3) & (share < 0.4 + 1e-3)).all()
    assert ((aspect > 3 / 4 - 1e-3) & (aspect < 4 / 3 + 1e-3)).all()
    assert (x.amin((1, 2)) >= 0.5 - 1e-3).all() and (x.amax((1, 2)) <= W - 0.5 + 1e-3).all()  # inside the image
    flipped = step_x[:, 0, 0] < 0
    assert 0.3 < flipped.float().mean() < 0.7


def test_colour_operations_equal_torchvisions(images):
    f = torch.tensor([0.6, 1.4])
    for ours, theirs in ((_brightness, TF.adjust_brightness), (_contrast, TF.adjust_contrast),
                         (_saturation, TF.adjust_saturation)):
        expected = torch.stack([theirs(images[i], float(f[i])) for i in range(2)])
        assert_close(ours(images, f), expected, atol=1e-4, rtol=0)  # grey: PIL's 0.299 against 0.2989
    assert_close(solarize(images, 1.0), TF.solarize(images, 0.5))
    assert_close(_hue(images, torch.zeros(2)), images, atol=1e-5, rtol=0)
    turned = _hue(images, torch.tensor([0.25, -0.25]))
    assert (turned - images).abs().mean() > 0.02  # colours move, luma stays (where nothing clips)
    luma = torch.tensor([0.299, 0.587, 0.114]).view(1, 3, 1, 1)
    unclipped = ((turned > 0) & (turned < 1)).all(1, keepdim=True)
    assert_close(((turned - images) * luma).sum(1, keepdim=True)[unclipped].abs().max(), torch.tensor(0.0),
                 atol=1e-4, rtol=0)


def test_blur_equals_torchvisions_gaussian_blur(images):
    ours = gaussian_blur(images, 1.0, (1.5, 1.5))
    k = 2 * 5 + 1  # radius ceil(3 sigma)
    assert_close(ours, TF.gaussian_blur(images, [k, k], [1.5, 1.5]), atol=1e-5, rtol=0)
    assert torch.equal(gaussian_blur(images, 0.0, (1.5, 1.5)), images)


def test_multicrop_gives_normalised_global_and_local_crops(images):
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    x = (images - mean.view(1, 3, 1, 1)) / std.view(1, 3, 1, 1)
    mc = MultiCrop(global_size=48, local_size=24, local_crops=3)
    glob, local = mc(x, mean, std, torch.Generator().manual_seed(0))
    assert glob.shape == (2, 2, 3, 48, 48) and local.shape == (3, 2, 3, 24, 24)
    pixels = torch.cat([glob.movedim(2, -1).reshape(-1, 3), local.movedim(2, -1).reshape(-1, 3)]).T
    lo, hi = (0 - mean) / std, (1 - mean) / std
    assert ((pixels >= lo.view(3, 1) - 1e-4) & (pixels <= hi.view(3, 1) + 1e-4)).all()
    again, _ = mc(x, mean, std, torch.Generator().manual_seed(0))
    assert torch.equal(glob, again)  # the draws come from the generator given
    with pytest.raises(ValueError, match="global_scale"):
        MultiCrop(global_scale=(0.5, 0.2))
    with pytest.raises(ValueError, match="crop sizes must be >= 1 px"):
        MultiCrop(local_size=0)
