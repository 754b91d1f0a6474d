"""Manifests: a CSV or JSON-lines file that lists images (paths relative to the file) and their labels, one or
several per image; the class list they use, multi-hot targets, and a dataset that skips unreadable files."""

from __future__ import annotations

import csv
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor
from torch.utils.data import Dataset

from vitkit.errors import MissingFileError, UsageError

from .folder import Decoder, _read_image

log = logging.getLogger(__name__)

JSON_LINES = (".jsonl", ".ndjson")
MANIFEST_SUFFIXES = (".csv", *JSON_LINES)


@dataclass
class Manifest:
    """A manifest's rows: each image's path and the names of its labels, and the file they came from."""

    path: Path
    images: list[Path]
    labels: list[list[str]]
    lines: list[str] = field(default_factory=list)  # where each row stands in the file ("line 7")
    label_column: str = "labels"

    def where(self, i: int, column: str | None = None) -> str:
        """Row ``i`` as every error names it: the file, its line and the column."""
        line = self.lines[i] if i < len(self.lines) else f"row {i + 1}"
        return f"{self.path} {line}, column {column or self.label_column!r}"

    def names(self) -> list[str]:
        """Every label name the rows use, sorted."""
        return sorted({name for row in self.labels for name in row})


def _split_labels(value, separator: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, list):
        return [str(v).strip() for v in value if str(v).strip()]
    return [v.strip() for v in str(value).split(separator) if v.strip()]


def _rows(path: Path, image_column: str, label_column: str):
    """(row number as a user counts it, image cell, label cell) of a CSV (with a header) or JSON-lines file."""
    if path.suffix.lower() in JSON_LINES:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise UsageError(f"{path} line {n}: not a JSON object ({e.msg})") from None
                if not isinstance(row, dict):
                    raise UsageError(f"{path} line {n}: expected a JSON object with {image_column!r} and "
                                     f"{label_column!r}, got a JSON {type(row).__name__}")
                if label_column not in row:
                    raise UsageError(f"{path} line {n}: no {label_column!r} field (an image without labels has an "
                                     "empty list)")
                yield f"line {n}", row.get(image_column), row[label_column]
        return
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        missing = [c for c in (image_column, label_column) if c not in header]
        if missing:
            raise UsageError(f"{path}: no column {' or '.join(map(repr, missing))} in its header {header}; expected "
                             f"{image_column!r} (image paths) and {label_column!r} (label names), or name yours "
                             "with --data.image_column / --data.label_column")
        for n, row in enumerate(reader, 2):  # line 1 is the header
            yield f"line {n}", row.get(image_column), row.get(label_column)


def read_manifest(path: str | Path, image_column: str = "image", label_column: str = "labels",
                  separator: str = " ") -> Manifest:
    """The rows of a manifest. A path is relative to the manifest's folder (or absolute); a cell of labels holds
    names separated by ``separator`` (a JSON-lines row may give a list). An empty path, or a file that is not
    there, ends in one line naming the row and the file."""
    path = Path(os.path.expanduser(path))
    if not path.is_file():
        raise MissingFileError(f"manifest {str(path)!r} does not exist or is not a file; expected a CSV or JSON-lines "
                               f"file with an {image_column!r} and a {label_column!r} column")
    images, labels, lines = [], [], []
    try:
        for where, image, cell in _rows(path, image_column, label_column):
            images.append(_image_path(path, where, image, image_column))
            labels.append(_split_labels(cell, separator))
            lines.append(where)
    except (UnicodeDecodeError, csv.Error) as e:
        raise UsageError(f"{path} is not a CSV or JSON-lines text file in UTF-8 ({type(e).__name__}: {e})") from None
    if not images:
        raise UsageError(f"{path} lists no images")
    return Manifest(path, images, labels, lines, label_column)


def _image_path(manifest: Path, where: str, image, column: str) -> Path:
    """A row's image file, relative to the manifest's folder; an empty path or a missing file ends in one line."""
    written = "" if image is None else str(image).strip()
    if not written:
        raise UsageError(f"{manifest} {where}, column {column!r}: the {column!r} path is empty")
    if "\0" in written:
        raise UsageError(f"{manifest} {where}, column {column!r}: the {column!r} path {written!r} holds a NUL byte")
    file = Path(os.path.expanduser(written))  # "~name/..." of no user here stays as written, and is not there
    file = file if file.is_absolute() else manifest.parent / file
    try:
        exists = file.is_file()
    except OSError:  # a path the system cannot hold (too long)
        exists = False
    if not exists:
        raise MissingFileError(f"{manifest} {where}, column {column!r}: image {str(file)!r} does not exist")
    return file


def check_rows(manifest: Manifest, classes: list[str], multi_label: bool) -> None:
    """Refuse a row with a label not in ``classes``, or (single-label) a row without exactly one label."""
    known = set(classes)
    for i, row in enumerate(manifest.labels):
        unknown = [name for name in row if name not in known]
        if unknown:
            shown = ", ".join(classes[:20]) + (", ..." if len(classes) > 20 else "")
            raise UsageError(f"{manifest.where(i)}: label {unknown[0]!r} is not one of the {len(classes)} classes "
                             f"({shown}); image {str(manifest.images[i])!r}")
        if not multi_label and len(row) != 1:
            what = "no label" if not row else f"{len(row)} labels ({' '.join(row)})"
            raise UsageError(f"{manifest.where(i)}: {what}; a single-label manifest needs one per row "
                             f"(--data.multi_label true takes several, or none); image {str(manifest.images[i])!r}")


def targets(manifest: Manifest, classes: list[str], multi_label: bool) -> Tensor:
    """Class indices (N,) for single-label rows, multi-hot float rows (N, C) for multi-label ones."""
    index = {c: i for i, c in enumerate(classes)}
    if not multi_label:
        return torch.tensor([index[row[0]] for row in manifest.labels], dtype=torch.long)
    out = torch.zeros(len(manifest.labels), len(classes))
    for i, row in enumerate(manifest.labels):
        out[i, [index[name] for name in row]] = 1.0
    return out


class ManifestImages(Dataset):
    """A manifest's images and targets (an index, or a multi-hot row); an unreadable file yields None, skipped and
    counted as :class:`~vitkit.data.folder.SkippingImageFolder` skips it."""

    def __init__(self, files: list[Path], targets: Tensor, transform, decoder: Decoder = "pil") -> None:
        self.files, self.targets, self.transform, self.decoder = list(files), targets, transform, decoder
        self.samples = [(str(f), t) for f, t in zip(self.files, targets.tolist(), strict=True)]

    def __len__(self) -> int:
        return len(self.files)

    def with_transform(self, transform) -> ManifestImages:
        """The same files under another transform."""
        return ManifestImages(self.files, self.targets, transform, self.decoder)

    def __getitem__(self, i: int):
        try:
            return self.transform(_read_image(str(self.files[i]), self.decoder)), self.targets[i]
        except (OSError, SyntaxError, ValueError) as e:  # PIL: UnidentifiedImageError, truncated data
            log.debug("skipping unreadable image %s: %s", self.files[i], e)
            return None
