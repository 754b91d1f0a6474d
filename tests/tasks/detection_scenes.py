"""Scenes of scikit-learn's digits for detection: 1 to 3 digits of several sizes on a dark canvas, none overlapping,
their boxes and classes written as a COCO folder or a YOLO folder."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image
from sklearn.datasets import load_digits


def scenes(n: int, size: int = 64, seed: int = 0, digits: tuple[int, int] = (1, 3), scale: tuple[int, int] = (14, 26)):
    """``n`` (image uint8 HxWx3 of a random aspect, boxes (M, 4) x0 y0 x1 y1 in pixels, labels (M,))."""
    rng = np.random.default_rng(seed)
    data = load_digits()
    out = []
    for _ in range(n):
        h, w = size, int(size * rng.choice([1.0, 1.25, 0.75]))
        canvas = np.zeros((h, w), np.float32)
        boxes, labels = [], []
        for _ in range(int(rng.integers(digits[0], digits[1] + 1))):
            k, s = int(rng.integers(len(data.images))), int(rng.integers(*scale))
            for _ in range(30):
                x, y = int(rng.integers(0, w - s)), int(rng.integers(0, h - s))
                if all(x + s <= b[0] or b[2] <= x or y + s <= b[1] or b[3] <= y for b in boxes):
                    break
            else:
                continue
            digit = Image.fromarray((data.images[k] * 16).astype(np.uint8)).resize((s, s), Image.BILINEAR)
            canvas[y:y + s, x:x + s] = np.maximum(canvas[y:y + s, x:x + s], np.asarray(digit, np.float32))
            boxes.append([x, y, x + s, y + s])
            labels.append(int(data.target[k]))
        image = np.repeat(canvas.clip(0, 255).astype(np.uint8)[..., None], 3, axis=2)
        out.append((image, np.array(boxes, np.float32).reshape(-1, 4), np.array(labels, np.int64)))
    return out


NAMES = [str(i) for i in range(10)]


def write_coco(root: Path, splits: dict[str, int], size: int = 64, seed: int = 0, step: int = 1) -> Path:
    """``root/annotations/<split>.json`` over ``root/<split>/*.png``; class c's category id is ``1 + step * c``
    (``step`` > 1: ids with gaps, as COCO's own)."""
    (root / "annotations").mkdir(parents=True, exist_ok=True)
    for j, (split, n) in enumerate(splits.items()):
        (root / split).mkdir(exist_ok=True)
        images, annotations = [], []
        for i, (image, boxes, labels) in enumerate(scenes(n, size, seed + 1000 * j)):
            name = f"{i:04d}.png"
            Image.fromarray(image).save(root / split / name)
            images.append({"id": i, "file_name": name, "height": image.shape[0], "width": image.shape[1]})
            for box, label in zip(boxes.tolist(), labels.tolist(), strict=True):
                annotations.append({"id": len(annotations), "image_id": i, "category_id": 1 + step * label,
                                    "iscrowd": 0,
                                    "bbox": [box[0], box[1], box[2] - box[0], box[3] - box[1]],
                                    "area": (box[2] - box[0]) * (box[3] - box[1])})
        categories = [{"id": 1 + step * c, "name": name} for c, name in enumerate(NAMES)]
        (root / "annotations" / f"{split}.json").write_text(
            json.dumps({"images": images, "annotations": annotations, "categories": categories}))
    return root


def write_yolo(root: Path, splits: dict[str, int], size: int = 64, seed: int = 0) -> Path:
    """Ultralytics' layout: ``images/<split>/*.png``, ``labels/<split>/*.txt`` and ``data.yaml``."""
    for j, (split, n) in enumerate(splits.items()):
        (root / "images" / split).mkdir(parents=True, exist_ok=True)
        (root / "labels" / split).mkdir(parents=True, exist_ok=True)
        for i, (image, boxes, labels) in enumerate(scenes(n, size, seed + 1000 * j)):
            Image.fromarray(image).save(root / "images" / split / f"{i:04d}.png")
            h, w = image.shape[:2]
            lines = [f"{c} {(b[0] + b[2]) / 2 / w} {(b[1] + b[3]) / 2 / h} {(b[2] - b[0]) / w} {(b[3] - b[1]) / h}"
                     for b, c in zip(boxes.tolist(), labels.tolist(), strict=True)]
            (root / "labels" / split / f"{i:04d}.txt").write_text("\n".join(lines))
    (root / "data.yaml").write_text("names:\n" + "".join(f"  {i}: '{n}'\n" for i, n in enumerate(NAMES)))
    return root


def write_voc(root: Path, splits: dict[str, int], size: int = 64, seed: int = 0) -> Path:
    """Pascal VOC's layout of the classes ``NAMES``: ``ImageSets/Main/<split>.txt``, ``Annotations/<id>.xml`` with
    VOC's 1-based pixel indices, ``JPEGImages/`` (PNG files here, named in each XML)."""
    for sub in ("ImageSets/Main", "Annotations", "JPEGImages"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    for j, (split, n) in enumerate(splits.items()):
        ids = []
        for i, (image, boxes, labels) in enumerate(scenes(n, size, seed + 1000 * j)):
            ids.append(f"{split}_{i:04d}")
            Image.fromarray(image).save(root / "JPEGImages" / f"{ids[-1]}.png")
            objects = "".join(f"<object><name>{NAMES[c]}</name><difficult>0</difficult><bndbox><xmin>{b[0] + 1:g}"
                              f"</xmin><ymin>{b[1] + 1:g}</ymin><xmax>{b[2]:g}</xmax><ymax>{b[3]:g}</ymax></bndbox>"
                              "</object>" for b, c in zip(boxes.tolist(), labels.tolist(), strict=True))
            (root / "Annotations" / f"{ids[-1]}.xml").write_text(
                f"<annotation><filename>{ids[-1]}.png</filename>{objects}</annotation>")
        (root / "ImageSets" / "Main" / f"{split}.txt").write_text("\n".join(ids) + "\n")
    return root


def write_hf(root: Path, splits: dict[str, int], size: int = 64, seed: int = 0) -> Path:
    """A Hugging Face ``DatasetDict`` saved to disk in transformers' detection guide's layout (cppe-5's): an image
    column and an objects column of COCO ``bbox`` (x, y, w, h) and a ``category`` ClassLabel."""
    import datasets

    objects = datasets.Sequence({"id": datasets.Value("int64"), "area": datasets.Value("float32"),
                                 "bbox": datasets.Sequence(datasets.Value("float32"), length=4),
                                 "category": datasets.ClassLabel(names=NAMES)})
    features = datasets.Features({"image": datasets.Image(), "objects": objects})
    parts = {}
    for j, (split, n) in enumerate(splits.items()):
        rows = {"image": [], "objects": []}
        for image, boxes, labels in scenes(n, size, seed + 1000 * j):
            xywh = [[b[0], b[1], b[2] - b[0], b[3] - b[1]] for b in boxes.tolist()]
            rows["image"].append(Image.fromarray(image))
            rows["objects"].append({"id": list(range(len(labels))), "area": [w * h for *_, w, h in xywh],
                                    "bbox": xywh, "category": labels.tolist()})
        parts[split] = datasets.Dataset.from_dict(rows, features=features)
    datasets.DatasetDict(parts).save_to_disk(str(root))
    return root
