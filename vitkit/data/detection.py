"""Images with boxes, in the layouts people have, as torchvision's detection datasets give them: an image and a
target of ``boxes`` (``tv_tensors.BoundingBoxes``, corners in pixels), ``labels`` (class indices from 0) and
``iscrowd``, so that ``torchvision.transforms.v2`` moves the boxes with the image (flips, crops, resizes: no box
geometry written here).

* COCO: one JSON file per split (``images``, ``annotations`` with ``bbox`` as x, y, width, height in pixels,
  ``categories``), the images in a folder. Category ids map to indices in the order of their ids; a crowd
  annotation (``iscrowd: 1``) is kept and marked, as COCO's evaluation ignores it; an image without annotations is a
  sample with no boxes.
* YOLO (Ultralytics): ``images/<split>/x.jpg`` beside ``labels/<split>/x.txt``, a line per object ``class cx cy w
  h`` relative to the image, the class names in the data YAML's ``names``; an image without a label file has no
  boxes.
* Pascal VOC: ``ImageSets/Main/<split>.txt`` listing ids, ``Annotations/<id>.xml`` over ``JPEGImages/``; a
  ``difficult`` object is kept as an ignored region.
* Hugging Face datasets with an image column and an ``objects`` column (``bbox``, ``category``), as transformers'
  detection guide reads cppe-5.

A box of no area (width or height 0 after it is clipped to the image; a COCO file's boxes are clipped to the sizes
its images list) is dropped, counted in ``dropped``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import yaml
from PIL import Image
from torch.utils.data import Dataset
from torchvision import tv_tensors
from torchvision.transforms.v2 import functional as TF

from vitkit.errors import MissingFileError, UsageError
from vitkit.image_files import IMAGE_SUFFIXES, eight_bit


def _image(path: Path) -> tv_tensors.Image:
    if not path.is_file():
        raise MissingFileError(f"image {path} is not there")
    with Image.open(path) as img:
        return tv_tensors.Image(TF.pil_to_tensor(eight_bit(img).convert("RGB")))


def _target(xyxy: torch.Tensor, labels: torch.Tensor, crowd: torch.Tensor, size: tuple[int, int]) -> dict[str, Any]:
    return {"boxes": tv_tensors.BoundingBoxes(xyxy.reshape(-1, 4), format="XYXY", canvas_size=size),
            "labels": labels.long(), "iscrowd": crowd.bool()}


def _kept(xyxy: torch.Tensor, size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The boxes clipped to the image, and which of them still have an area."""
    h, w = size
    xyxy = torch.stack([xyxy[:, 0].clamp(0, w), xyxy[:, 1].clamp(0, h), xyxy[:, 2].clamp(0, w),
                        xyxy[:, 3].clamp(0, h)], dim=1)
    return xyxy, (xyxy[:, 2] > xyxy[:, 0]) & (xyxy[:, 3] > xyxy[:, 1])


class DetectionImages(Dataset):
    """What the layouts share: (image path, boxes in corners, labels, crowd flags) per sample, read and transformed
    on demand. ``transform`` is a ``torchvision.transforms.v2`` transform called as ``transform(image, target)``.
    ``category_ids``: a COCO file's category id of each class (index order), None for the other layouts."""

    def __init__(self, samples: list[tuple[Path, torch.Tensor, torch.Tensor, torch.Tensor]], class_names: list[str],
                 transform=None, dropped: int = 0, category_ids: list | None = None) -> None:
        self.samples, self.class_names, self.transform, self.dropped = samples, class_names, transform, dropped
        self.category_ids = category_ids

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        path, xyxy, labels, crowd = self.samples[i]
        image = _image(path)
        size = tuple(image.shape[-2:])
        xyxy, keep = _kept(xyxy, size)
        target = _target(xyxy[keep], labels[keep], crowd[keep], size)
        return self.transform(image, target) if self.transform is not None else (image, target)


def _need(record: Any, keys: tuple[str, ...], where: str) -> None:
    if not isinstance(record, dict) or any(k not in record for k in keys):
        raise UsageError(f"{where}: expected an object with {', '.join(keys)}, got {str(record)[:120]}")
    for key in ("id", "image_id", "category_id"):
        if key in keys and (not isinstance(record[key], (int, str)) or isinstance(record[key], bool)):
            raise UsageError(f"{where}: {key} must be an integer or a string, got {str(record[key])[:40]}")


def _list(data: dict, key: str, where: Path) -> list:
    if not isinstance(data[key], list):
        raise UsageError(f"{where}: {key!r} must be a list, got {str(data[key])[:60]}")
    return data[key]


def _bbox(value: Any, where: str) -> list[float]:
    if not (isinstance(value, list) and len(value) == 4
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)):
        raise UsageError(f"{where}: bbox must be [x, y, width, height] in pixels, got {str(value)[:60]}")
    return [float(v) for v in value]


def coco(images: str | os.PathLike, annotations: str | os.PathLike, transform=None) -> DetectionImages:
    """A COCO split: the JSON file ``annotations`` over the images under ``images`` (its ``file_name``s)."""
    images, annotations = Path(images), Path(annotations)
    if not annotations.is_file():
        raise MissingFileError(f"COCO annotations {annotations} are not there")
    try:
        data = json.loads(annotations.read_text())
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError; so is a number too long
        raise UsageError(f"{annotations} is not a COCO JSON file ({e})") from None
    _need(data, ("images", "annotations", "categories"), str(annotations))
    categories, found_annotations, images_listed = (_list(data, k, annotations)
                                                    for k in ("categories", "annotations", "images"))
    for c in categories:
        _need(c, ("id", "name"), f"{annotations}: a category")
    try:
        ids = sorted({c["id"] for c in categories})
    except TypeError:  # ids of both kinds, numbers and strings
        raise UsageError(f"{annotations}: the category ids mix numbers and strings") from None
    if len(ids) != len(categories):
        raise UsageError(f"{annotations}: two categories share an id")
    index = {cid: i for i, cid in enumerate(ids)}
    names = {c["id"]: str(c["name"]) for c in categories}
    per_image: dict[Any, list[dict]] = {}
    for a in found_annotations:
        _need(a, ("image_id", "bbox", "category_id"), f"{annotations}: an annotation")
        a = {**a, "bbox": _bbox(a["bbox"], f"{annotations}: annotation {str(a.get('id'))[:20]}")}
        if a["category_id"] not in index:
            raise UsageError(f"{annotations}: annotation {a.get('id')} has category_id {a['category_id']}, which "
                             f"no category has (ids {ids[:10]})")
        per_image.setdefault(a["image_id"], []).append(a)
    samples, dropped = [], 0
    for img in images_listed:
        _need(img, ("id", "file_name"), f"{annotations}: an image")
        if not isinstance(img["file_name"], str) or not img["file_name"]:
            raise UsageError(f"{annotations}: an image's file_name must be a path, got {str(img['file_name'])[:40]}")
        found = per_image.get(img["id"], [])
        xywh = torch.tensor([a["bbox"] for a in found], dtype=torch.float32).reshape(-1, 4)
        xyxy = torch.cat([xywh[:, :2], xywh[:, :2] + xywh[:, 2:]], dim=1)
        if isinstance(img.get("width"), (int, float)) and isinstance(img.get("height"), (int, float)):
            xyxy = torch.minimum(xyxy.clamp(min=0), torch.tensor([img["width"], img["height"]] * 2,
                                                                 dtype=torch.float32))  # the image's own size
        keep = (xyxy[:, 2] > xyxy[:, 0]) & (xyxy[:, 3] > xyxy[:, 1])
        dropped += int((~keep).sum())
        labels = torch.tensor([index[a["category_id"]] for a in found], dtype=torch.long)
        crowd = torch.tensor([a.get("iscrowd") in (1, True) for a in found], dtype=torch.bool)
        samples.append((images / img["file_name"], xyxy[keep], labels[keep], crowd[keep]))
    _all_there([p for p, *_ in samples], f"{annotations} lists", images)
    return DetectionImages(samples, [names[i] for i in ids], transform, dropped, ids)


def _all_there(paths: list[Path], who: str, where: Path) -> None:
    """One line naming the first of ``paths`` that is not a file, and how many are not, before any is read."""
    missing = [p for p in paths if not p.is_file()]
    if missing:
        raise MissingFileError(f"{who} {len(missing)} image(s) that are not there, e.g. {missing[0]} (the images are "
                               f"read from {where})")


YOLO_YAMLS = ("data.yaml", "dataset.yaml", "data.yml")  # where an Ultralytics folder names its classes


def yolo_names(root: Path, given: list[str] | None) -> list[str]:
    """The classes of a YOLO folder: ``names`` given, else its data YAML's (a list, or Ultralytics' mapping of index
    to name)."""
    if given:
        return list(given)
    for name in YOLO_YAMLS:
        path = root / name
        if path.is_file():
            try:
                names = (yaml.safe_load(path.read_text()) or {}).get("names")
            except (yaml.YAMLError, AttributeError) as e:
                raise UsageError(f"{path} is not a data YAML with names ({e})") from None
            if isinstance(names, dict):
                names = [names[k] for k in sorted(names)]
            if isinstance(names, list) and names:
                return [str(n) for n in names]
            raise UsageError(f"{path}: names must be a list of class names or a mapping of index to name, got "
                             f"{str(names)[:60]}")
    raise MissingFileError(f"{root} has no data.yaml naming its classes (names: [...]); give --data.names")


def yolo(root: str | os.PathLike, split: str, names: list[str] | None = None, transform=None) -> DetectionImages:
    """An Ultralytics split: ``root/images/<split>/*`` with ``root/labels/<split>/<stem>.txt`` (``class cx cy w h``
    per line, relative), ``names`` the classes in index order (default: the data YAML's ``names``)."""
    root = Path(root)
    if names is None:
        names = yolo_names(root, None)
    folder = root / "images" / split
    if not folder.is_dir():
        raise MissingFileError(f"{folder} is not there: expected {root}/images/{split}/*.jpg beside "
                               f"{root}/labels/{split}/*.txt")
    samples, dropped = [], 0
    for path in sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES):
        label = root / "labels" / split / f"{path.stem}.txt"
        rows = []
        if label.is_file():
            for n, line in enumerate(label.read_text().splitlines(), 1):
                if not line.strip():
                    continue
                parts = line.split()
                try:
                    if len(parts) != 5:
                        raise ValueError
                    cls, cx, cy, w, h = int(parts[0]), *map(float, parts[1:5])
                except ValueError:
                    polygon = " (a segmentation polygon?)" if len(parts) > 6 and len(parts) % 2 else ""
                    raise UsageError(f"{label}:{n}: expected 'class cx cy w h' (relative), got {len(parts)} fields"
                                     f"{polygon}: {line[:80]!r}") from None
                if not 0 <= cls < len(names):
                    raise UsageError(f"{label}:{n}: class {cls}, and the data names {len(names)} classes")
                rows.append((cls, cx, cy, w, h))
        with Image.open(path) as img:
            W, H = img.size
        rel = torch.tensor([r[1:] for r in rows], dtype=torch.float32).reshape(-1, 4)
        xyxy = torch.cat([rel[:, :2] - rel[:, 2:] / 2, rel[:, :2] + rel[:, 2:] / 2], dim=1) * torch.tensor(
            [W, H, W, H], dtype=torch.float32)
        keep = (rel[:, 2] > 0) & (rel[:, 3] > 0)
        dropped += int((~keep).sum())
        labels = torch.tensor([r[0] for r in rows], dtype=torch.long)
        samples.append((path, xyxy[keep], labels[keep], torch.zeros(int(keep.sum()), dtype=torch.bool)))
    return DetectionImages(samples, list(names), transform, dropped)


def normalised_targets(target: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A transformed target as the set loss takes it: ``labels`` and ``boxes`` as centre x, centre y, width, height
    relative to the (transformed) image, crowd boxes left out."""
    boxes = target["boxes"]
    h, w = boxes.canvas_size
    keep = ~target["iscrowd"]
    cxcywh = TF.convert_bounding_box_format(boxes, new_format=tv_tensors.BoundingBoxFormat.CXCYWH)
    scale = torch.tensor([w, h, w, h], dtype=torch.float32)
    return {"labels": target["labels"][keep], "boxes": cxcywh.as_subclass(torch.Tensor)[keep].float() / scale}


VOC_CLASSES = ["aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow", "diningtable",
               "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa", "train", "tvmonitor"]


def _voc_number(obj, tag: str, where: str) -> float:
    node = obj.find(f"bndbox/{tag}")
    try:
        return float(node.text)
    except (AttributeError, TypeError, ValueError):
        raise UsageError(f"{where}: an object's bndbox has no number {tag}") from None


def voc(root: str | os.PathLike, split: str, names: list[str] | None = None, transform=None) -> DetectionImages:
    """A Pascal VOC split: the ids of ``root/ImageSets/Main/<split>.txt``, each ``root/Annotations/<id>.xml`` over
    ``root/JPEGImages/<id>.jpg``. Boxes are VOC's 1-based pixel indices, made corners as detectron2 reads them
    (``xmin - 1, ymin - 1, xmax, ymax``); an object marked ``difficult`` is kept as an ignored region (as COCO's
    crowd: VOC's own evaluation neither counts nor misses it). ``names``: the classes in index order (VOC's 20 by
    default)."""
    from xml.etree import ElementTree

    root, names = Path(root), list(names or VOC_CLASSES)
    listing = root / "ImageSets" / "Main" / f"{split}.txt"
    if not listing.is_file():
        raise MissingFileError(f"{listing} is not there: a VOC folder lists each split's ids in ImageSets/Main/")
    index = {n: i for i, n in enumerate(names)}
    samples, dropped = [], 0
    for image_id in (line.split()[0] for line in listing.read_text().splitlines() if line.strip()):
        where = root / "Annotations" / f"{image_id}.xml"
        if not where.is_file():
            raise MissingFileError(f"{where} is not there (listed in {listing})")
        try:
            tree = ElementTree.parse(where).getroot()
        except ElementTree.ParseError as e:
            raise UsageError(f"{where} is not VOC XML ({e})") from None
        boxes, labels, hard = [], [], []
        for obj in tree.iter("object"):
            name = (obj.findtext("name") or "").strip()
            if name not in index:
                raise UsageError(f"{where}: an object of class {name!r}, which is not one of the data's "
                                 f"{len(names)} classes ({', '.join(names[:6])}...; --data.names)")
            x0, y0, x1, y1 = (_voc_number(obj, t, str(where)) for t in ("xmin", "ymin", "xmax", "ymax"))
            boxes.append([x0 - 1, y0 - 1, x1, y1])
            labels.append(index[name])
            hard.append((obj.findtext("difficult") or "0").strip() == "1")
        xyxy = torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4)
        keep = (xyxy[:, 2] > xyxy[:, 0]) & (xyxy[:, 3] > xyxy[:, 1])
        dropped += int((~keep).sum())
        file = (tree.findtext("filename") or f"{image_id}.jpg").strip()
        samples.append((root / "JPEGImages" / file, xyxy[keep], torch.tensor(labels, dtype=torch.long)[keep],
                        torch.tensor(hard, dtype=torch.bool)[keep]))
    _all_there([p for p, *_ in samples], f"{listing} lists", root / "JPEGImages")
    return DetectionImages(samples, names, transform, dropped)


class HFDetectionImages(Dataset):
    """Rows of a Hugging Face dataset with an image column and an objects column (transformers' detection guide's
    layout, cppe-5's): ``objects`` holds ``bbox`` (a box per object, ``bbox_format`` ``xywh``: COCO's x, y, width,
    height, or ``xyxy``: corners, in pixels) and ``category`` (class indices), and ``iscrowd`` where the dataset has
    it. Read as :class:`DetectionImages` reads files."""

    def __init__(self, rows, image_column: str, objects_column: str, class_names: list[str], bbox_format: str,
                 transform=None) -> None:
        self.rows, self.image_column, self.objects_column = rows, image_column, objects_column
        self.class_names, self.bbox_format, self.transform, self.dropped = class_names, bbox_format, transform, 0
        self.category_ids = None  # the category feature's values are the class indices

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int):
        from vitkit.data.hf import image_of

        row = self.rows[i]
        image = tv_tensors.Image(TF.pil_to_tensor(image_of(row[self.image_column], "pil").convert("RGB")))
        size = tuple(image.shape[-2:])
        objects = row[self.objects_column] or {}
        where = f"row {i}'s {self.objects_column}"
        if not isinstance(objects, dict) or "bbox" not in objects or "category" not in objects:
            raise UsageError(f"{where}: expected a mapping with bbox and category, got {str(objects)[:80]}")
        boxes = [_bbox(b, where) for b in objects["bbox"]]
        labels = torch.tensor(objects["category"], dtype=torch.long).reshape(-1)
        if len(labels) != len(boxes) or (len(labels) and (labels.min() < 0 or labels.max() >= self.num_classes)):
            raise UsageError(f"{where}: {len(boxes)} boxes and {len(labels)} categories, each a class index below "
                             f"{self.num_classes}")
        xyxy = torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4)
        if self.bbox_format == "xywh":
            xyxy = torch.cat([xyxy[:, :2], xyxy[:, :2] + xyxy[:, 2:]], dim=1)
        crowd = torch.tensor(objects.get("iscrowd") or [False] * len(labels), dtype=torch.bool).reshape(-1)
        xyxy, keep = _kept(xyxy, size)
        target = _target(xyxy[keep], labels[keep], crowd[keep], size)
        return self.transform(image, target) if self.transform is not None else (image, target)
