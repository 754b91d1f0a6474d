"""Images with boxes (``vitkit.data.detection``): a COCO JSON split and an Ultralytics YOLO split of the same
scenes give the same boxes and classes; torchvision's v2 transforms move the boxes with the image; crowd, empty and
zero-area annotations are kept, allowed and dropped as COCO's tools do; bad files end in one line."""

import json

import pytest
import torch
from PIL import Image
from torchvision.transforms import v2

from vitkit.data.detection import coco, normalised_targets, voc, yolo
from vitkit.errors import MissingFileError, UsageError

# scenes of 60 x 40 px: (file, [(class name, x, y, w, h) in pixels])
SCENES = [("a.png", [("cat", 5, 4, 20, 10), ("dog", 30, 20, 25, 15)]),
          ("b.png", [("dog", 0, 0, 60, 40)]),
          ("c.png", [])]
NAMES = ["cat", "dog"]


def _write(root):
    (root / "images" / "train").mkdir(parents=True)
    (root / "labels" / "train").mkdir(parents=True)
    images, annotations = [], []
    for i, (name, objects) in enumerate(SCENES):
        Image.new("RGB", (60, 40), (i * 40, 0, 0)).save(root / "images" / "train" / name)
        images.append({"id": 10 + i, "file_name": name, "width": 60, "height": 40})
        lines = []
        for j, (cls, x, y, w, h) in enumerate(objects):
            annotations.append({"id": 100 * i + j, "image_id": 10 + i, "category_id": 7 if cls == "cat" else 9,
                                "bbox": [x, y, w, h], "area": w * h, "iscrowd": 0})
            lines.append(f"{NAMES.index(cls)} {(x + w / 2) / 60} {(y + h / 2) / 40} {w / 60} {h / 40}")
        if objects:
            (root / "labels" / "train" / f"{name[:-4]}.txt").write_text("\n".join(lines) + "\n")
    data = {"images": images, "annotations": annotations,
            "categories": [{"id": 9, "name": "dog"}, {"id": 7, "name": "cat"}]}
    (root / "train.json").write_text(json.dumps(data))
    return data


def test_coco_and_yolo_give_the_same_boxes_and_classes(tmp_path):
    _write(tmp_path)
    from_coco = coco(tmp_path / "images" / "train", tmp_path / "train.json")
    from_yolo = yolo(tmp_path, "train", NAMES)
    assert from_coco.class_names == NAMES == from_yolo.class_names  # category ids in order: 7 cat, 9 dog
    assert len(from_coco) == len(from_yolo) == 3
    for i, (_, objects) in enumerate(SCENES):
        (image, a), (_, b) = from_coco[i], from_yolo[i]
        assert image.shape == (3, 40, 60) and image.dtype == torch.uint8
        expected = torch.tensor([[x, y, x + w, y + h] for _, x, y, w, h in objects], dtype=torch.float32)
        torch.testing.assert_close(a["boxes"].as_subclass(torch.Tensor), expected.reshape(-1, 4))
        torch.testing.assert_close(b["boxes"].as_subclass(torch.Tensor), expected.reshape(-1, 4), atol=1e-4, rtol=0)
        assert a["labels"].tolist() == b["labels"].tolist() == [NAMES.index(c) for c, *_ in objects]
    (tmp_path / "data.yaml").write_text("names: {0: cat, 1: dog}\n")
    assert yolo(tmp_path, "train").class_names == NAMES  # the data YAML's names where none are given


def test_v2_transforms_move_the_boxes_with_the_image(tmp_path):
    _write(tmp_path)
    flip = coco(tmp_path / "images" / "train", tmp_path / "train.json",
                v2.Compose([v2.RandomHorizontalFlip(p=1.0), v2.Resize((20, 30))]))
    image, target = flip[0]
    assert image.shape == (3, 20, 30)
    # cat at x 5..25 of 60 px, flipped to 35..55, then halved; dog 30..55 -> 5..30 -> 2.5..15
    torch.testing.assert_close(target["boxes"].as_subclass(torch.Tensor),
                               torch.tensor([[17.5, 2.0, 27.5, 7.0], [2.5, 10.0, 15.0, 17.5]]))
    rel = normalised_targets(target)
    torch.testing.assert_close(rel["boxes"][0], torch.tensor([22.5 / 30, 4.5 / 20, 10 / 30, 5 / 20]))


def test_crowd_empty_and_zero_area_annotations(tmp_path):
    data = _write(tmp_path)
    data["annotations"][0]["iscrowd"] = 1
    data["annotations"].append({"id": 999, "image_id": 11, "category_id": 7, "bbox": [3, 3, 0, 5]})
    (tmp_path / "train.json").write_text(json.dumps(data))
    split = coco(tmp_path / "images" / "train", tmp_path / "train.json")
    assert split.dropped == 1
    _, target = split[0]
    assert target["iscrowd"].tolist() == [True, False]
    assert normalised_targets(target)["labels"].tolist() == [1]  # the crowd cat is no object to match
    _, empty = split[2]
    assert empty["boxes"].shape == (0, 4) and normalised_targets(empty)["boxes"].shape == (0, 4)


def test_bad_files_end_in_one_line(tmp_path):
    data = _write(tmp_path)
    with pytest.raises(MissingFileError, match="COCO annotations .*nope.json are not there"):
        coco(tmp_path, tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(UsageError, match="is not a COCO JSON file"):
        coco(tmp_path, tmp_path / "bad.json")
    data["annotations"][0]["category_id"] = 3
    (tmp_path / "train.json").write_text(json.dumps(data))
    with pytest.raises(UsageError, match="has category_id 3, which no category has"):
        coco(tmp_path / "images" / "train", tmp_path / "train.json")
    data["annotations"][0]["category_id"] = 7
    data["images"][1]["file_name"] = "gone.png"
    (tmp_path / "train.json").write_text(json.dumps(data))
    with pytest.raises(MissingFileError, match=r"train.json lists 1 image\(s\) that are not there, e.g. .*gone.png"):
        coco(tmp_path / "images" / "train", tmp_path / "train.json")  # found when the file is read, not mid-epoch
    (tmp_path / "labels" / "train" / "a.txt").write_text("0 0.5 0.5\n")
    with pytest.raises(UsageError, match=r"a.txt:1: expected 'class cx cy w h' \(relative\), got 3 fields"):
        yolo(tmp_path, "train", NAMES)
    (tmp_path / "labels" / "train" / "a.txt").write_text("0 0.1 0.1 0.5 0.1 0.5 0.5\n")
    with pytest.raises(UsageError, match=r"a.txt:1: .*got 7 fields \(a segmentation polygon\?\)"):
        yolo(tmp_path, "train", NAMES)
    with pytest.raises(MissingFileError, match="has no data.yaml naming its classes"):
        yolo(tmp_path, "train")
    (tmp_path / "labels" / "train" / "a.txt").write_text("5 0.5 0.5 0.1 0.1\n")
    with pytest.raises(UsageError, match="class 5, and the data names 2 classes"):
        yolo(tmp_path, "train", NAMES)
    with pytest.raises(MissingFileError, match="images/val is not there"):
        yolo(tmp_path, "val", NAMES)


def _write_voc(root, difficult=()):
    """SCENES as a VOC folder: 1-based pixel indices (VOC's ``xmin`` is COCO's ``x + 1``)."""
    for sub in ("ImageSets/Main", "Annotations", "JPEGImages"):
        (root / sub).mkdir(parents=True)
    for i, (name, objects) in enumerate(SCENES):
        Image.new("RGB", (60, 40), (i * 40, 0, 0)).save(root / "JPEGImages" / name)
        xml = "".join(
            f"<object><name>{cls}</name><difficult>{int((i, j) in difficult)}</difficult><bndbox><xmin>{x + 1}"
            f"</xmin><ymin>{y + 1}</ymin><xmax>{x + w}</xmax><ymax>{y + h}</ymax></bndbox></object>"
            for j, (cls, x, y, w, h) in enumerate(objects))
        (root / "Annotations" / f"{name[:-4]}.xml").write_text(
            f"<annotation><filename>{name}</filename><size><width>60</width><height>40</height></size>{xml}"
            "</annotation>")
    (root / "ImageSets/Main/train.txt").write_text("".join(f"{name[:-4]}\n" for name, _ in SCENES))


def test_voc_gives_the_boxes_of_coco_and_keeps_difficult_objects_as_ignored(tmp_path):
    _write(tmp_path)
    _write_voc(tmp_path / "voc", difficult={(0, 1)})
    from_coco = coco(tmp_path / "images" / "train", tmp_path / "train.json")
    from_voc = voc(tmp_path / "voc", "train", NAMES)
    assert len(from_voc) == 3 and from_voc.class_names == NAMES
    for i in range(3):
        (xa, a), (xb, b) = from_coco[i], from_voc[i]
        assert torch.equal(xa, xb)
        torch.testing.assert_close(b["boxes"].as_subclass(torch.Tensor), a["boxes"].as_subclass(torch.Tensor))
        assert b["labels"].tolist() == a["labels"].tolist()
    assert from_voc[0][1]["iscrowd"].tolist() == [False, True]  # the difficult dog: neither counted nor missed
    assert normalised_targets(from_voc[0][1])["labels"].tolist() == [0]


def test_bad_voc_files_end_in_one_line(tmp_path):
    _write_voc(tmp_path)
    assert voc(tmp_path, "train").class_names[7] == "cat"  # VOC's own 20 classes by default
    with pytest.raises(UsageError, match=r"a.xml: an object of class 'cat', which is not one of the data's 2"):
        voc(tmp_path, "train", ["dog", "bird"])
    with pytest.raises(MissingFileError, match=r"ImageSets/Main/val.txt is not there"):
        voc(tmp_path, "val", NAMES)
    (tmp_path / "Annotations" / "c.xml").rename(tmp_path / "c.xml")
    with pytest.raises(MissingFileError, match=r"c.xml is not there \(listed in"):
        voc(tmp_path, "train", NAMES)
    (tmp_path / "c.xml").rename(tmp_path / "Annotations" / "c.xml")
    (tmp_path / "Annotations" / "b.xml").write_text("<annotation><object><name>dog</name></annotation>")
    with pytest.raises(UsageError, match=r"b.xml is not VOC XML"):
        voc(tmp_path, "train", NAMES)
    (tmp_path / "Annotations" / "b.xml").write_text(
        "<annotation><object><name>dog</name><bndbox><xmin>1</xmin></bndbox></object></annotation>")
    with pytest.raises(UsageError, match=r"b.xml: an object's bndbox has no number ymin"):
        voc(tmp_path, "train", NAMES)
