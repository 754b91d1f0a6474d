"""Hugging Face datasets as labelled images: opening a hub name or local files through the ``datasets`` library
(offline-first), finding the image and label columns, and the torch datasets that decode, transform and skip.

The ``datasets`` library reads every format (parquet, arrow, imagefolder, webdataset, a ``save_to_disk``
folder); vitkit only decodes the image bytes, with the same decoder and transforms as for folders, so a row
whose image is broken is skipped and counted as an unreadable file is.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset

from vitkit.errors import MissingFileError, MissingPackageError, UsageError
from vitkit.image_files import IMAGE_SUFFIXES

from .folder import Decoder, decode

log = logging.getLogger(__name__)

# the packaged reader of local data files, by how their names end
BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".tar": "webdataset"}


class MissingDatasetError(MissingFileError):
    """A hub dataset that is not in the datasets cache and cannot be downloaded (offline, or no network)."""


def require() -> None:
    """The datasets library, or the line that installs it."""
    try:
        import datasets  # noqa: F401
    except ImportError:
        raise MissingPackageError(
            "reading Hugging Face datasets needs the datasets library: pip install 'vitkit[hf]'") \
            from None


def cache_dir() -> str:
    import datasets

    return str(datasets.config.HF_DATASETS_CACHE)


@contextmanager
def _offline():
    """The datasets library without network calls: its cache alone answers (as ``HF_DATASETS_OFFLINE=1``)."""
    import datasets

    was, datasets.config.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE, True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = was


def _builder_of(data_files: str | list[str] | dict) -> str:
    files = data_files.values() if isinstance(data_files, dict) else [data_files]
    first = next(iter(files))
    first = str(first[0] if isinstance(first, (list, tuple)) else first)
    suffix = Path(first.split("::")[0]).suffix.lower()
    if suffix in BUILDERS:
        return BUILDERS[suffix]
    if suffix in IMAGE_SUFFIXES or Path(first).is_dir() or suffix == ".zip":
        return "imagefolder"
    raise UsageError(f"--data.data_files {first!r}: expected parquet, arrow, webdataset (.tar) or image files")


def open_dataset(name: str | None, *, config_name: str | None = None, revision: str | None = None,
                 data_files: Any = None, streaming: bool = False, argument: str = "--data.name",
                 instead: str = "a local folder or --data.data_files") -> dict[str, Any]:
    """Every split of a dataset, by split name: a hub name (offline-first: the cache answers before the network),
    a folder written by ``save_to_disk``, a folder of data files, or ``data_files`` in a packaged format.
    ``argument`` is what the user gave ``name`` as, and ``instead`` what else the command takes; the errors name
    them."""
    require()
    import datasets

    if data_files is not None:
        return dict(datasets.load_dataset(_builder_of(data_files), name=config_name, data_files=data_files,
                                          streaming=streaming))
    if name is None:
        raise UsageError("give --data.name (a hub dataset or a local folder) or --data.data_files")
    path = Path(os.path.expanduser(name))
    if path.is_dir():
        if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():  # save_to_disk
            loaded = datasets.load_from_disk(str(path))
            splits = dict(loaded) if isinstance(loaded, datasets.DatasetDict) else {"train": loaded}
            return {k: v.to_iterable_dataset(num_shards=max(1, min(256, len(v)))) if streaming else v
                    for k, v in splits.items()}
        return dict(datasets.load_dataset(str(path), name=config_name, streaming=streaming))
    if path.exists() or os.sep in name and not _hub_like(name):
        raise MissingFileError(f"{argument} {name!r} is neither a folder nor a hub dataset name")
    return _from_hub(name, config_name, revision, streaming, instead)


def open_splits(name: str | None, data_files: Any, *, config_name: str | None, revision: str | None,
                streaming: bool, train_split: str, val_split: str, test_split: str | None,
                val_fraction: float) -> tuple[Any, str]:
    """:func:`open_dataset` for a data module: its splits, and the validation split's name as the dataset has it
    (``validation``, or ``val`` / ``valid``). A dataset that cannot be opened, a split it lacks or a ``val_fraction``
    outside (0, 1) ends in one line that names the dataset."""
    from vitkit.errors import one_line

    where = name if name is not None else str(data_files)
    if not 0 < val_fraction < 1:
        raise UsageError(f"val_fraction must be in (0, 1), got {val_fraction}")
    try:
        splits = open_dataset(name, config_name=config_name, revision=revision, data_files=data_files,
                              streaming=streaming)
    except (MissingDatasetError, ValueError, FileNotFoundError) as e:
        if "corresponds to no data" in str(e):  # the datasets library on files without a row
            raise UsageError(f"{where} has no rows") from None
        if isinstance(e, MissingDatasetError) or "vitkit" in type(e).__module__ or "--data." in str(e):
            raise
        raise UsageError(f"{where} cannot be opened by the datasets library: {one_line(e)[7:]}") from None
    if train_split not in splits:
        raise UsageError(f"{where} has no split {train_split!r} (--data.train_split); its splits are "
                         f"{', '.join(splits) or 'none'}")
    if val_split == "validation" and val_split not in splits:  # the other names datasets give it
        val_split = next((k for k in ("val", "valid") if k in splits), val_split)
    for arg, split, default in (("val_split", val_split, "validation"), ("test_split", test_split, "test")):
        if split is not None and split not in splits and split != default:
            raise UsageError(f"{where} has no split {split!r} (--data.{arg}); its splits are {', '.join(splits)}")
    return splits, val_split


def _hub_like(name: str) -> bool:
    return name.count("/") == 1 and not name.startswith((".", "/", "~"))


def _from_hub(name: str, config_name: str | None, revision: str | None, streaming: bool,
              instead: str) -> dict[str, Any]:
    import datasets

    kw = dict(name=config_name, revision=revision, streaming=streaming)
    try:
        with _offline():
            return dict(datasets.load_dataset(name, **kw))
    except (FileNotFoundError, ConnectionError, ValueError) as cached_error:
        if datasets.config.HF_HUB_OFFLINE:
            raise _missing(name, "offline mode is on (HF_DATASETS_OFFLINE / HF_HUB_OFFLINE)", instead) from None
        try:
            return dict(datasets.load_dataset(name, **kw))
        except (ConnectionError, OSError) as e:
            raise _missing(name, f"it could not be downloaded ({type(e).__name__})", instead) from None
        except datasets.exceptions.DatasetNotFoundError:
            raise _missing(name, f"the hub has no such dataset ({cached_error})", instead) from None


def _missing(name: str, why: str, instead: str) -> MissingDatasetError:
    return MissingDatasetError(f"dataset {name!r} is not in the datasets cache ({cache_dir()}) and {why}; fetch it "
                               f"where there is a network with `vitkit download --dataset {name}` (the same cache "
                               f"folder, HF_DATASETS_CACHE), or give {instead}")


def download(name: str, config_name: str | None = None, revision: str | None = None) -> dict[str, int]:
    """Fetch a hub dataset into the datasets cache; returns the rows of each split."""
    import datasets

    loaded = datasets.load_dataset(name, name=config_name, revision=revision)
    return {split: len(ds) for split, ds in loaded.items()}


# -- columns --------------------------------------------------------------------------------------------------


def describe_columns(features) -> str:
    return ", ".join(f"{k} ({_kind(v)})" for k, v in features.items())


def _kind(feature) -> str:
    import datasets

    if isinstance(feature, datasets.ClassLabel):
        return f"ClassLabel, {feature.num_classes} classes"
    if isinstance(feature, datasets.Value):
        return feature.dtype
    if isinstance(feature, datasets.List):
        return f"a list of {_kind(feature.feature)}"
    return type(feature).__name__


def _label_value(feature) -> bool:
    """A ClassLabel, or integers or strings: one label."""
    import datasets

    return isinstance(feature, datasets.ClassLabel) or isinstance(feature, datasets.Value) and (
        feature.dtype.startswith(("int", "uint")) or feature.dtype in ("string", "large_string"))


def multi_label(feature) -> bool:
    """Several labels per row: a list of ClassLabels, of class names or of class indices, or a fixed-length
    multi-hot list (integers, booleans or floats, one per class)."""
    import datasets

    if not isinstance(feature, datasets.List):
        return False
    return _label_value(feature.feature) or _multi_hot(feature)


def _multi_hot(feature) -> bool:
    """A fixed-length list of numbers (``List(Value('int8'), length=C)``), or a list of booleans: one per class."""
    import datasets

    inner = feature.feature
    return feature.length > 0 and isinstance(inner, datasets.Value) and (
        inner.dtype.startswith(("int", "uint", "float")) or inner.dtype == "bool") or \
        isinstance(inner, datasets.Value) and inner.dtype == "bool"


def find_columns(features, image_column: str | None, label_column: str | None, where: str) -> tuple[str, str]:
    """The image column (the one ``Image`` feature unless named) and the label column (the one ``ClassLabel``
    unless named; a named one may hold integers or strings); an error names the columns there are."""
    import datasets

    if features is None:
        raise UsageError(f"{where}: the dataset does not declare its columns; name them with --data.image_column "
                         "and --data.label_column")
    columns = describe_columns(features)
    for arg, col in (("image_column", image_column), ("label_column", label_column)):
        if col is not None and col not in features:
            raise UsageError(f"{where}: --data.{arg} {col!r} is not a column; its columns are {columns}")
    images = [k for k, v in features.items() if isinstance(v, datasets.Image)]
    if image_column is None:
        if len(images) != 1:
            raise UsageError(f"{where} has {'no' if not images else len(images)} image column(s), expected one; "
                             f"its columns are {columns}" + ("; name one with --data.image_column" if images else ""))
        image_column = images[0]
    elif not isinstance(features[image_column], (datasets.Image, datasets.Value)) or \
            isinstance(features[image_column], datasets.Value) and features[image_column].dtype not in ("binary",
                                                                                                           "string"):
        raise UsageError(f"{where}: --data.image_column {image_column!r} is {_kind(features[image_column])}, not "
                         f"images; its columns are {columns}")
    labels = [k for k, v in features.items() if isinstance(v, datasets.ClassLabel) or
              isinstance(v, datasets.List) and isinstance(v.feature, datasets.ClassLabel)]
    if label_column is None:
        if len(labels) != 1:
            raise UsageError(f"{where} has {'no' if not labels else len(labels)} ClassLabel column(s), expected one; "
                             f"its columns are {columns}; name the label column with --data.label_column")
        label_column = labels[0]
    feature = features[label_column]
    if not (_label_value(feature) or multi_label(feature)):
        raise UsageError(f"{where}: --data.label_column {label_column!r} is {_kind(feature)}, not a label (a "
                         f"ClassLabel, integers or strings, or a list of those or a multi-hot list for several "
                         f"labels per image); its columns are {columns}")
    return image_column, label_column


def class_names(ds, label_column: str, given: list[str] | None, where: str) -> list[str]:
    """The class names: a ClassLabel's own, else ``given``, else (map-style data) the sorted values of the column;
    integer labels 0..N-1 are named by their number."""
    import datasets

    feature = ds.features[label_column]
    if multi_label(feature):
        return _multi_label_names(ds, label_column, given, where)
    if isinstance(feature, datasets.ClassLabel):
        return list(feature.names)
    if given:
        return list(given)
    if isinstance(ds, datasets.IterableDataset):
        raise UsageError(f"{where}: the label column {label_column!r} holds {feature.dtype} values, and a stream "
                         "cannot be read through to find its classes; give them with --data.classes")
    values = ds.unique(label_column)
    if feature.dtype.startswith(("int", "uint")):
        top = max(values) if values else -1
        if min(values, default=0) < 0:
            raise UsageError(f"{where}: the label column {label_column!r} holds negative labels")
        return [str(i) for i in range(top + 1)]
    return sorted(values)


def _multi_label_names(ds, label_column: str, given: list[str] | None, where: str) -> list[str]:
    """A list column's classes: its ClassLabel's names, else ``given``, else a multi-hot list's positions or (map-style
    data) the sorted values the rows hold."""
    import datasets

    feature = ds.features[label_column]
    if isinstance(feature.feature, datasets.ClassLabel):
        return list(feature.feature.names)
    if _multi_hot(feature):
        if feature.length < 0 and not given:
            raise UsageError(f"{where}: the multi-hot column {label_column!r} does not declare its length; name the "
                             "classes with --data.classes")
        if given and feature.length > 0 and len(given) != feature.length:
            raise UsageError(f"{where}: --data.classes names {len(given)} classes, the multi-hot column "
                             f"{label_column!r} has {feature.length}")
        return list(given) if given else [str(i) for i in range(feature.length)]
    if given:
        return list(given)
    if isinstance(ds, datasets.IterableDataset):
        raise UsageError(f"{where}: the label column {label_column!r} holds lists of {feature.feature.dtype}, and a "
                         "stream cannot be read through to find its classes; give them with --data.classes")
    values = sorted({v for row in ds[label_column] for v in (row or [])})
    if feature.feature.dtype.startswith(("int", "uint")):
        if values and values[0] < 0:
            raise UsageError(f"{where}: the label column {label_column!r} holds negative labels")
        return [str(i) for i in range((values[-1] + 1) if values else 0)]
    return [str(v) for v in values]


def multi_hot_of(feature, classes: list[str]):
    """A function from a row's list of labels (ClassLabel indices, class indices, names, or a multi-hot list) to
    its multi-hot row (C,)."""
    import datasets
    import torch

    c = len(classes)
    if _multi_hot(feature):
        def dense(value) -> torch.Tensor:
            row = torch.tensor([float(v) for v in value or []])
            if len(row) != c:
                raise UsageError(f"a multi-hot label of {len(row)} values, expected one per class ({c})")
            return row
        return dense
    index = None if isinstance(feature.feature, datasets.ClassLabel) or feature.feature.dtype.startswith(
        ("int", "uint")) else {name: i for i, name in enumerate(classes)}

    def hot(value) -> torch.Tensor:
        row = torch.zeros(c)
        for v in value or []:
            j = int(v) if index is None else index.get(v)
            if j is None or not 0 <= j < c:
                raise UsageError(f"label {v!r} is not one of the {c} classes")
            row[j] = 1.0
        return row

    return hot


def label_index(feature, classes: list[str]):
    """A function from a row's label value to its class index (to its multi-hot row, for several labels)."""
    import datasets

    if multi_label(feature):
        return multi_hot_of(feature, classes)
    if isinstance(feature, datasets.ClassLabel) or feature.dtype.startswith(("int", "uint")):
        return int
    index = {c: i for i, c in enumerate(classes)}

    def lookup(value: str) -> int:
        try:
            return index[value]
        except KeyError:
            raise UsageError(f"label {value!r} is not one of the {len(classes)} classes") from None

    return lookup


def image_of(value: Any, decoder: Decoder):
    """A row's image (bytes and/or a path, as ``Image(decode=False)`` gives it, or raw bytes) as an RGB image."""
    if isinstance(value, dict):
        data, path = value.get("bytes"), value.get("path")
        if data is None:
            if not path:
                raise OSError("the row has no image bytes and no path")
            with open(path, "rb") as f:
                data = f.read()
        return decode(data, decoder)
    if isinstance(value, (bytes, bytearray)):
        return decode(bytes(value), decoder)
    if isinstance(value, str):
        with open(value, "rb") as f:
            return decode(f.read(), decoder)
    raise OSError(f"an image value of type {type(value).__name__}")


def undecoded(ds, image_column: str):
    """The dataset with its image column as bytes and paths, for vitkit's decoder (PIL or torchvision)."""
    import datasets

    if isinstance(ds.features[image_column], datasets.Image):
        return ds.cast_column(image_column, datasets.Image(decode=False))
    return ds


class HFImages(Dataset):
    """A map-style split as ``(image, label)``; a row whose image does not decode yields None (skipped and
    counted by the data module). ``samples`` gives each row's path (or row number) and label, as folders do."""

    def __init__(self, ds, image_column: str, label_column: str, to_index, transform,
                 decoder: Decoder = "pil") -> None:
        self.ds = undecoded(ds.select_columns([image_column, label_column]), image_column)
        self.image_column, self.label_column, self.to_index = image_column, label_column, to_index
        self.transform, self.decoder = transform, decoder

    def __len__(self) -> int:
        return len(self.ds)

    @property
    def samples(self) -> list[tuple[str, int]]:
        images = self.ds.select_columns([self.image_column]).to_dict()[self.image_column]
        paths = [v.get("path") if isinstance(v, dict) else None for v in images]
        labels = self.ds[self.label_column]
        return [(p or f"row {i}", self.to_index(y)) for i, (p, y) in enumerate(zip(paths, labels, strict=True))]

    def __getitem__(self, i: int):
        row = self.ds[int(i)]
        try:
            img = image_of(row[self.image_column], self.decoder)
        except (OSError, SyntaxError, ValueError) as e:  # PIL: UnidentifiedImageError, truncated data
            log.debug("skipping row %d: its image does not decode: %s", i, e)
            return None
        return self.transform(img), self.to_index(row[self.label_column])


class StreamPosition:
    """A stream over ``self.ds`` (a ``datasets`` IterableDataset) whose epoch and position are the stream's own: its
    ``state_dict``, which a ``StatefulDataLoader`` saves per loader worker."""

    ds: Any

    def set_epoch(self, epoch: int) -> None:
        self.ds.set_epoch(epoch)

    def state_dict(self) -> dict:
        return self.ds.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.ds.load_state_dict(state)


class HFStream(StreamPosition, IterableDataset):
    """A streamed split as ``(image, label)`` (None for a row that does not decode), its position the stream's."""

    def __init__(self, ds, image_column: str, label_column: str, to_index, transform,
                 decoder: Decoder = "pil") -> None:
        self.ds = undecoded(ds.select_columns([image_column, label_column]), image_column)
        self.image_column, self.label_column, self.to_index = image_column, label_column, to_index
        self.transform, self.decoder = transform, decoder

    def __iter__(self):
        for row in self.ds:
            try:
                img = image_of(row[self.image_column], self.decoder)
            except (OSError, SyntaxError, ValueError) as e:
                log.debug("skipping a streamed row: its image does not decode: %s", e)
                yield None
                continue
            yield self.transform(img), self.to_index(row[self.label_column])


def carve(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Row indices of (train, val) for a dataset without a validation split: a seeded draw of ``fraction`` of
    its ``n`` rows, the same on every rank and run."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    n_val = max(1, round(n * fraction))
    return sorted(order[n_val:]), sorted(order[:n_val])


def split_rows(name: str | None, data_files: Any, *, config_name: str | None, revision: str | None,
               train_split: str, val_split: str, test_split: str | None, val_fraction: float, seed: int,
               columns: dict[str, str]) -> dict[str, Any]:
    """The rows of a map-style dataset by split (``train``, ``val``, and ``test`` where it has one), each of
    ``columns`` (the column -> the flag that names it) checked on the training rows; without a validation split,
    ``val_fraction`` of the training rows held out by ``seed`` (:func:`carve`), said in one line."""
    from lightning.pytorch.utilities import rank_zero_info

    where = str(name if name is not None else data_files)
    splits, val_split = open_splits(name, data_files, config_name=config_name, revision=revision, streaming=False,
                                    train_split=train_split, val_split=val_split, test_split=test_split,
                                    val_fraction=val_fraction)
    train = splits[train_split]
    for column in columns:
        if column not in train.column_names:
            raise UsageError(f"{where} has no column {column!r} ({', '.join(columns.values())}); its columns are "
                             f"{', '.join(train.column_names)}")
    rows = {"train": train}
    if val_split in splits:
        rows["val"] = splits[val_split]
    else:  # a fixed share of the training rows held out, the same on every rank and run
        kept, held = carve(len(train), val_fraction, seed)
        rows = {"train": train.select(kept), "val": train.select(held)}
        rank_zero_info(f"data: {where} has no split {val_split!r}; {len(held)} of its {len(train)} training rows are "
                       f"held out for validation (--data.val_fraction {val_fraction}, seed {seed})")
    if test_split is not None and test_split in splits:
        rows["test"] = splits[test_split]
    return rows
