"""Images with depth maps (``vitkit.data.depth``): a 16-bit PNG, a .npy array and a float TIFF of the same map read the
same; the v2 transforms move the map with the image; what a depth folder can get wrong ends in one line."""

import numpy as np
import pytest
import torch
from PIL import Image

from vitkit.data.depth import DepthImages, depth_pairs, read_depth
from vitkit.data.modules.depth import DepthTransform
from vitkit.errors import MissingFileError, UsageError


def _folder(root, depth: np.ndarray, suffix: str, split: str = "train"):
    (root / "images" / split).mkdir(parents=True, exist_ok=True)
    (root / "depth" / split).mkdir(parents=True, exist_ok=True)
    h, w = depth.shape
    image = np.zeros((h, w, 3), np.uint8)
    image[:, : w // 2] = 255  # the left half white: where a flip puts it is seen
    Image.fromarray(image).save(root / "images" / split / "a.jpg")
    path = root / "depth" / split / f"a{suffix}"
    if suffix == ".npy":
        np.save(path, depth)
    elif suffix == ".png":
        Image.fromarray(np.round(depth * 1000).astype(np.uint16)).save(path)
    else:
        Image.fromarray(depth.astype(np.float32), mode="F").save(path)
    return root


def test_a_png_a_npy_and_a_tiff_of_one_map_read_the_same(tmp_path):
    depth = np.linspace(0.5, 9.5, 12 * 16, dtype=np.float32).reshape(12, 16).round(3)
    depth[0, 0] = 0  # no measurement
    read = {s: DepthImages(depth_pairs(_folder(tmp_path / s[1:], depth, s), "train"))[0][1]
            for s in (".npy", ".png", ".tiff")}
    for suffix, got in read.items():
        assert got.shape == (12, 16) and got.dtype == torch.float32, suffix
        torch.testing.assert_close(got.as_subclass(torch.Tensor), torch.from_numpy(depth), atol=1e-3, rtol=0)


def test_the_map_moves_with_the_image(tmp_path):
    depth = np.tile(np.arange(1, 17, dtype=np.float32), (12, 1))  # depth grows to the right
    ds = DepthImages(depth_pairs(_folder(tmp_path, depth, ".npy"), "train"), transform=DepthTransform(8, True, 1.0))
    image, moved = ds[0]
    assert image.shape == (3, 8, 8) and moved.shape == (8, 8)
    assert image[0, 0, -1] > 200 and image[0, 0, 0] < 50  # the white left half is now on the right
    assert moved[0, 0] > moved[0, -1]  # and the depth now shrinks to the right: nearest, never blended
    assert set(moved.unique().tolist()) <= set(range(1, 17))
    _, kept = DepthImages(depth_pairs(tmp_path, "train"), transform=DepthTransform(8, False))[0]
    assert kept.shape == (12, 16)  # evaluation scores the map at its own size


def test_bad_depth_files_end_in_one_line_and_bad_values_are_masked_and_counted(tmp_path, caplog):
    depth = np.full((6, 8), 2.0, np.float32)
    depth[0, :3] = [np.nan, -1, np.inf]
    values, bad = read_depth(_folder(tmp_path, depth, ".npy") / "depth/train/a.npy")
    assert bad == 3 and (values[0, :3] == 0).all() and (values[1:] == 2).all()
    assert "a.npy: 3 negative or non-finite value(s), left out as no measurement" in caplog.text
    Image.new("L", (8, 6)).save(tmp_path / "depth/train/a.png")
    with pytest.raises(UsageError, match=r"a.npy and .*a.png: two depth maps of one name"):
        depth_pairs(tmp_path, "train")
    with pytest.raises(UsageError, match=r"a.png is a L PNG; a depth PNG holds one channel of 16 bits"):
        read_depth(tmp_path / "depth/train/a.png")  # 8 bits would be read as millimetres up to 0.255 m
    (tmp_path / "depth/train/a.png").unlink()
    np.save(tmp_path / "depth/train/a.npy", np.ones((5, 8), np.float32))
    with pytest.raises(UsageError, match=r"a.npy is 5x8 and its image .*a.jpg 6x8: a depth map has its image's size"):
        DepthImages(depth_pairs(tmp_path, "train"))[0]
    (tmp_path / "depth/train/a.npy").unlink()
    with pytest.raises(MissingFileError, match=r"a.jpg has no depth map in .*depth/train"):
        depth_pairs(tmp_path, "train")
    with pytest.raises(MissingFileError, match=r"images/val is not there: a depth folder holds images/val/"):
        depth_pairs(tmp_path, "val")
    (tmp_path / "x.jpg").write_bytes(b"")
    with pytest.raises(UsageError, match="a depth map is a 16-bit PNG, a .npy array or a float TIFF, not .jpg"):
        read_depth(tmp_path / "x.jpg")
    Image.new("RGB", (4, 4)).save(tmp_path / "rgb.png")
    with pytest.raises(UsageError, match="rgb.png is a RGB PNG; a depth PNG holds one channel of 16 bits"):
        read_depth(tmp_path / "rgb.png")
    np.save(tmp_path / "cube.npy", np.ones((2, 2, 2)))
    with pytest.raises(UsageError, match=r"a depth map is one value per pixel \(H, W\), got shape \(2, 2, 2\)"):
        read_depth(tmp_path / "cube.npy")


def test_nyu_and_kitti_split_files_and_a_hugging_face_dataset_read_the_maps_of_a_folder(tmp_path):
    """BTS's split files (NYU: a focal after the pair; KITTI: depth maps under a root of their own, frames without
    ground truth listed as None) and a dataset with an image and a depth column give the folder's samples."""
    import datasets

    from vitkit.data.depth import list_pairs
    from vitkit.data.modules.depth import DepthDataModule, HFDepthDataModule

    depth = np.linspace(0.5, 9.5, 12 * 16, dtype=np.float32).reshape(12, 16).round(3)
    folder = _folder(tmp_path / "folder", depth, ".png")
    want_image, want_depth = DepthImages(depth_pairs(folder, "train"))[0]
    kitti = tmp_path / "kitti"
    (kitti / "raw/2011_09_26/drive_0001/image_02/data").mkdir(parents=True)
    (kitti / "gt/drive_0001/proj_depth/groundtruth/image_02").mkdir(parents=True)
    Image.open(folder / "images/train/a.jpg").save(kitti / "raw/2011_09_26/drive_0001/image_02/data/0001.jpg")
    Image.fromarray(np.round(depth * 256).astype(np.uint16)).save(
        kitti / "gt/drive_0001/proj_depth/groundtruth/image_02/0001.png")
    (kitti / "eigen_train.txt").write_text(
        "2011_09_26/drive_0001/image_02/data/0001.jpg drive_0001/proj_depth/groundtruth/image_02/0001.png 721.5\n"
        "2011_09_26/drive_0001/image_02/data/0002.jpg None 721.5\n")
    pairs = list_pairs(kitti / "raw", kitti / "eigen_train.txt", kitti / "gt")
    assert len(pairs) == 1  # the frame without ground truth left out
    dm = DepthDataModule(str(kitti / "raw"), train=str(kitti / "eigen_train.txt"), val=str(kitti / "eigen_train.txt"),
                         test=None, depth_root=str(kitti / "gt"), png_scale=256, img_size=8, num_workers=0)
    dm.setup("fit")
    image, got = DepthImages(pairs, 256)[0]
    torch.testing.assert_close(got.as_subclass(torch.Tensor), want_depth.as_subclass(torch.Tensor), atol=2e-3,
                               rtol=0)
    assert torch.equal(image.as_subclass(torch.Tensor), want_image.as_subclass(torch.Tensor))
    assert len(dm.train_set) == 1 and dm.val_set[0][1].shape == (12, 16)
    (kitti / "broken.txt").write_text("2011_09_26/drive_0001/image_02/data/0001.jpg\n")
    with pytest.raises(UsageError, match=r"broken.txt:1: expected 'image depth \[focal\]'"):
        list_pairs(kitti / "raw", kitti / "broken.txt")
    (kitti / "missing.txt").write_text("2011_09_26/drive_0001/image_02/data/0001.jpg nowhere.png\n")
    with pytest.raises(MissingFileError, match=r"missing.txt:1: .*nowhere.png is not there"):
        list_pairs(kitti / "raw", kitti / "missing.txt", kitti / "gt")
    rows = {"image": [Image.open(folder / "images/train/a.jpg")] * 3, "depth_map": [depth.tolist()] * 3}
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows)}).save_to_disk(str(tmp_path / "hf"))
    hf = HFDepthDataModule(str(tmp_path / "hf"), img_size=8, num_workers=0, val_fraction=0.34)
    hf.setup("fit")
    assert len(hf.train_set) == 2 and len(hf.val_set) == 1
    image, got = hf.val_set[0]
    torch.testing.assert_close(got, torch.from_numpy(depth))
    with pytest.raises(UsageError, match="has no column 'depth'.*its columns are image, depth_map"):
        HFDepthDataModule(str(tmp_path / "hf"), depth_column="depth", num_workers=0)
