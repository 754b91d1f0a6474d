"""The public segmentation datasets' folder layouts read as they are on disk, each written here in miniature: the
pairs found, the class indices as the benchmark counts them, and a missing file named."""

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vitkit.data.modules import SegmentationDataModule
from vitkit.errors import UsageError


def _png(path: Path, values: np.ndarray, mode: str | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    image = Image.fromarray(values.astype(np.uint8))
    if mode == "P":  # a palette PNG, as VOC's masks are: the pixel values are the indices
        image = image.convert("P")
        image.putpalette([v for i in range(256) for v in (i, 255 - i, (7 * i) % 256)])
    image.save(path)


def _image(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(path)


def _batch(dm: SegmentationDataModule, split: str = "val") -> torch.Tensor:
    dm.setup("fit")
    ds = dm.val_set if split == "val" else dm.train_set
    return torch.stack([ds[i][1] for i in range(len(ds))])


def test_ade20k_masks_lose_their_zero_class(tmp_path):
    root = tmp_path / "ADEChallengeData2016"
    for split in ("training", "validation"):
        for name in ("ADE_x_0001", "ADE_x_0002"):
            _image(root / "images" / split / f"{name}.jpg")
            _png(root / "annotations" / split / f"{name}.png", np.array([[0, 1], [150, 7]]).repeat(8, 0).repeat(8, 1))
    dm = SegmentationDataModule(str(root), layout="ade20k", img_size=16, batch_size=2, num_workers=0)
    assert dm.num_classes == 150
    masks = _batch(dm)
    assert masks.shape == (2, 16, 16) and set(masks.unique().tolist()) == {255, 0, 149, 6}  # 0 -> 255, k -> k - 1


def test_voc_reads_its_split_lists_and_palette_masks(tmp_path):
    root = tmp_path / "VOC2012"
    (root / "ImageSets" / "Segmentation").mkdir(parents=True)
    (root / "ImageSets" / "Segmentation" / "train.txt").write_text("2007_000032\n2007_000039\n")
    (root / "ImageSets" / "Segmentation" / "val.txt").write_text("2007_000033\n")
    for name in ("2007_000032", "2007_000039", "2007_000033", "2007_000099"):  # the last in no list
        _image(root / "JPEGImages" / f"{name}.jpg")
        _png(root / "SegmentationClass" / f"{name}.png", np.array([[0, 15], [255, 20]]).repeat(8, 0).repeat(8, 1),
             mode="P")
    dm = SegmentationDataModule(str(root), layout="voc", img_size=16, batch_size=1, num_workers=0)
    assert dm.num_classes == 21 and dm.classes[15] == "person"
    masks = _batch(dm)
    assert len(dm.train_set) == 2 and len(dm.val_set) == 1
    assert set(masks.unique().tolist()) == {0, 15, 20, 255}  # the indices, not the palette's colours


def test_cityscapes_pairs_each_image_with_its_train_ids(tmp_path):
    root = tmp_path / "cityscapes"
    for split, city in (("train", "aachen"), ("val", "frankfurt")):
        for n in ("000000_000019", "000001_000019"):
            _image(root / "leftImg8bit" / split / city / f"{city}_{n}_leftImg8bit.png")
            _png(root / "gtFine" / split / city / f"{city}_{n}_gtFine_labelTrainIds.png",
                 np.array([[0, 18], [255, 13]]).repeat(8, 0).repeat(8, 1))
    dm = SegmentationDataModule(str(root), layout="cityscapes", img_size=16, batch_size=2, num_workers=0)
    assert dm.num_classes == 19 and dm.classes[13] == "car"
    assert set(_batch(dm).unique().tolist()) == {0, 13, 18, 255}
    (root / "gtFine" / "val" / "frankfurt" / "frankfurt_000001_000019_gtFine_labelTrainIds.png").unlink()
    with pytest.raises(UsageError, match="frankfurt_000001_000019_leftImg8bit.png has no mask: expected .*"
                                         "frankfurt_000001_000019_gtFine_labelTrainIds.png"):
        SegmentationDataModule(str(root), layout="cityscapes", img_size=16, num_workers=0).setup("fit")


def test_a_layout_or_class_count_that_is_not_there_is_named(tmp_path):
    with pytest.raises(ValueError, match="layout must be one of folder, ade20k, voc, cityscapes, got 'coco'"):
        SegmentationDataModule(str(tmp_path), layout="coco")
    with pytest.raises(UsageError, match="images/train is not a folder: .*the classes are read from its training "
                                         "masks unless --data.num_classes gives them"):
        SegmentationDataModule(str(tmp_path))
    with pytest.raises(ValueError, match=r"scale must be \[low, high\] with 0 < low <= high .*got \[2.0, 0.5\]"):
        SegmentationDataModule(str(tmp_path), num_classes=3, scale=(2.0, 0.5))
    with pytest.raises(ValueError, match="hflip must be in"):
        SegmentationDataModule(str(tmp_path), num_classes=3, hflip=1.5)
    with pytest.raises(UsageError, match="ImageSets/Segmentation/train.txt is not there: Pascal VOC is"):
        SegmentationDataModule(str(tmp_path), layout="voc").setup("fit")
