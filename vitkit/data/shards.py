"""ImageNet-layout folders, manifests (``vitkit/data/manifest.py``) or Hugging Face datasets as litdata shards: the
conversion (``vitkit prepare-data``) and the dataset's marker.

A converted dataset is a folder with one litdata dataset per split (``OUT/train``, ``OUT/val``, optionally
``OUT/test``) and ``OUT/vitkit_dataset.json``, written last: a folder without it is an unfinished
conversion, which readers refuse and ``prepare-data`` resumes. Each sample keeps the file's original
encoded bytes (nothing is re-encoded), its class index (``label``), class name and path; with several labels per
image, ``label`` is a multi-hot row (uint8, one per class) and the class names are space-separated. A segmentation
dataset (a folder of images and masks in one of ``vitkit/data/segmentation.py``'s layouts) keeps each image's bytes
beside its mask's (``mask``), and the marker records ``"masks": true`` and the layout.

Each split is written in a seeded random order, as webdataset, FFCV and litdata users shuffle before writing:
a streaming loader mixes only within a window (litdata 0.2.76 permutes aligned blocks of 256 samples inside a
chunk, and on parallel filesystems whole chunks in windows of 16), so a split written class after class gives
batches of one or two classes. Written shuffled, every chunk and every block is a random draw of the split.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import re
import shutil
import sys
import zlib
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from vitkit.errors import ExistingFileError, MissingFileError, UsageError
from vitkit.image_files import image_files

from .folder import decode, scan_image_folder
from .manifest import MANIFEST_SUFFIXES, check_rows, read_manifest

MARKER = "vitkit_dataset.json"  # written last; its presence means every split is complete
INPUTS = ".vitkit_inputs.json"  # the file list a conversion started from, to resume only that one
# 1: class after class (vitkit before the shuffled write; refused by readers), 2: every split in a seeded random order
FORMAT = 2
# litdata starts its workers with spawn, which re-imports torch in each (seconds per split); fork shares what
# this process has loaded. Where fork is unavailable (Windows) or unsafe (macOS), litdata's default stays.
START_METHOD = "fork" if sys.platform.startswith("linux") else None

log = logging.getLogger(__name__)


# -- conversion ------------------------------------------------------------------------------------------

def _convert_one(item: list, root: str, skipped_log: str, dataset: str | None = None,
                 masks: bool = False) -> dict | None:
    """One file (or a Hugging Face ``dataset``'s row, ``split#index``; or with ``masks`` an image and its mask) ->
    one sample; an unreadable file gives None (litdata writes nothing for it) and a line in the split's list of
    skipped files."""
    rel, label, name = item
    if isinstance(label, list):  # several labels: a multi-hot row, one fixed-size field for litdata
        label = np.asarray(label, dtype=np.uint8)
    try:
        data = _row_bytes(dataset, rel) if dataset is not None else (Path(root) / rel).read_bytes()
        image = decode(data)  # the whole file decodes, so the shards hold only readable images
        if masks:
            mask = (Path(root) / label).read_bytes()
            _check_mask(mask, image.size)
    except Exception as e:  # noqa: BLE001 - PIL raises OSError, SyntaxError, ValueError, DecompressionBombError...
        with open(skipped_log, "a") as f:  # one short line per write: appends from workers do not interleave
            why = re.sub(r" <_io\.BytesIO object at 0x[0-9a-f]+>", "", str(e).splitlines()[0] if str(e) else "")
            f.write(f"{rel}\t{type(e).__name__}: {why}\n")
        return None
    if masks:
        return {"image": data, "mask": mask, "path": rel}
    return {"image": data, "label": label, "class_name": name, "path": rel}


def _check_mask(data: bytes, size: tuple[int, int]) -> None:
    """A mask that decodes whole, holds class indices and has its image's size; else an error that says which."""
    import io

    from PIL import Image

    from .segmentation import MASK_MODES

    with Image.open(io.BytesIO(data)) as mask:
        if mask.mode not in MASK_MODES:
            raise UsageError(f"the mask is a {mask.mode} image, not class indices (a single-channel or palette PNG)")
        if mask.size != size:
            raise UsageError(f"the mask is {mask.size[0]}x{mask.size[1]}, its image {size[0]}x{size[1]}")
        mask.load()


def _mask_inputs(root: Path, splits: tuple[str, ...], seed: int, layout: str) -> dict[str, list[list]]:
    """[image, mask, name] (paths relative to ``root``) of each split of a segmentation folder in ``layout``, in
    the split's seeded random order; train and val are required, test is taken where the layout has it."""
    from .segmentation import has_split, mask_pairs

    inputs = {}
    for split in splits:
        if split == "test" and not has_split(root, split, layout):
            continue
        items = [[str(i.relative_to(root)), str(m.relative_to(root)), i.stem]
                 for i, m in mask_pairs(root, split, layout)]
        order = np.random.default_rng([seed, zlib.crc32(split.encode())]).permutation(len(items))
        inputs[split] = [items[k] for k in order]
    return inputs


def _split_inputs(root: Path, split: str, classes: list[str], seed: int) -> list[list]:
    """[relative path, class index, class name] per file, in the split's seeded random order (lists: litdata
    compares them with its JSON checkpoint). The order depends on the seed, the split's name and the files."""
    items = [[str(f.relative_to(root)), i, c] for i, c in enumerate(classes) for f in image_files(root / split / c)]
    order = np.random.default_rng([seed, zlib.crc32(split.encode())]).permutation(len(items))
    return [items[k] for k in order]


_OPENED: dict[str, dict] = {}  # a Hugging Face dataset's splits, opened once per conversion worker


def _row_bytes(dataset: tuple[str, str], row: str) -> bytes:
    """The encoded image of row ``split#index`` of a Hugging Face dataset (its name or folder, its image column),
    as stored: its bytes, or the file its path names."""
    from .hf import open_dataset, undecoded

    name, column = dataset
    if name not in _OPENED:
        _OPENED.clear()
        _OPENED[name] = {k: undecoded(v, column) for k, v in open_dataset(name).items()}
    split, _, index = row.rpartition("#")
    value = _OPENED[name][split][int(index)][column]
    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    if isinstance(value, str):
        return Path(value).read_bytes()
    if not isinstance(value, (bytes, bytearray)):
        raise OSError("the row has no image bytes and no path")
    return bytes(value)


def _dataset_inputs(name: str, splits: tuple[str, ...], seed: int, image_column: str | None,
                    label_column: str | None) -> tuple[list[str], bool, dict[str, list[list]], tuple[str, str]]:
    """A Hugging Face dataset's (classes, several labels per image, ["split#index", label, names] per row of each
    split in a seeded order, (name, image column)); its validation split may be named val or valid."""
    from .hf import class_names, find_columns, label_index, multi_label, open_dataset

    opened = open_dataset(name, argument="root", instead="a folder written by save_to_disk as the root")
    names = {"train": ["train"], "val": ["validation", "val", "valid"], "test": ["test"]}
    found = {s: next((k for k in names[s] if k in opened), None) for s in splits}
    if found.get("train") is None or found.get("val") is None:
        raise UsageError(f"{name}: expected a train and a validation split, its splits are {', '.join(opened)}")
    train = opened[found["train"]]
    image_column, label_column = find_columns(train.features, image_column, label_column, name)
    classes = class_names(train, label_column, None, name)
    feature = train.features[label_column]
    multi, to_target = multi_label(feature), label_index(feature, classes)
    inputs = {}
    for split, key in found.items():
        if key is None:
            continue
        items = []
        for i, value in enumerate(opened[key][label_column]):
            target = to_target(value)
            label = [int(v) for v in target.tolist()] if multi else int(target)
            shown = " ".join(classes[j] for j, on in enumerate(label) if on) if multi else classes[label]
            items.append([f"{key}#{i}", label, shown])
        order = np.random.default_rng([seed, zlib.crc32(split.encode())]).permutation(len(items))
        inputs[split] = [items[k] for k in order]
    return classes, multi, inputs, (name, image_column)


def find_manifests(root: Path, splits: tuple[str, ...]) -> dict[str, Path]:
    """``root/train.csv``, ``root/val.csv`` (and ``test``; or ``.jsonl``) where ``root`` has no ``train`` folder."""
    if (root / "train").is_dir():
        return {}
    found = {s: next((root / f"{s}{x}" for x in MANIFEST_SUFFIXES if (root / f"{s}{x}").is_file()), None)
             for s in splits}
    return {s: p for s, p in found.items() if p is not None}


def _manifest_inputs(manifests: dict[str, Path], seed: int) -> tuple[list[str], bool, dict[str, list[list]]]:
    """(classes, several labels per image, [path, label, names] per row of each split in a seeded order)."""
    read = {s: read_manifest(p) for s, p in manifests.items()}
    multi = any(len(row) > 1 for row in read["train"].labels)
    classes = read["train"].names()
    inputs = {}
    for split, manifest in read.items():
        check_rows(manifest, classes, multi)
        index = {c: i for i, c in enumerate(classes)}
        items = []
        for file, row in zip(manifest.images, manifest.labels, strict=True):
            label = [int(c in row) for c in classes] if multi else index[row[0]]
            items.append([str(file.resolve()), label, " ".join(row)])
        order = np.random.default_rng([seed, zlib.crc32(split.encode())]).permutation(len(items))
        inputs[split] = [items[k] for k in order]
    return classes, multi, inputs


def _conversion_inputs(source: str | Path, splits: tuple[str, ...], seed: int, image_column: str | None,
                       label_column: str | None) -> tuple[str, list[str], bool, dict[str, list], tuple | None]:
    """(the source as recorded, classes, several labels per image, each split's [path, label, name] rows in their
    seeded order, a Hugging Face dataset's (name, image column) or None), from class folders, manifests, a folder
    written by ``datasets``' ``save_to_disk`` or ``hf:NAME`` (a hub dataset in the cache)."""
    text = str(source)
    root = Path(os.path.expanduser(text)).resolve()
    if text.startswith("hf:") or (root / "dataset_dict.json").is_file():
        name = text[3:] if text.startswith("hf:") else str(root)
        classes, multi, inputs, dataset = _dataset_inputs(name, splits, seed, image_column, label_column)
        return name, classes, multi, inputs, dataset
    manifests = find_manifests(root, splits) if root.is_dir() else {}
    if not manifests:
        present = [s for s in splits if (root / s).is_dir()]
        classes = scan_image_folder(root, "train", "val", "test" if "test" in present else None)
        return str(root), classes, False, {s: _split_inputs(root, s, classes, seed) for s in present}, None
    if "train" not in manifests or "val" not in manifests:
        raise MissingFileError(f"{root} has no train/ folder, and manifests for {', '.join(manifests)} only; "
                               "expected train.csv and val.csv (or .jsonl)")
    return (str(root), *_manifest_inputs(manifests, seed), None)


def prepare_data(root: str | Path, out: str | Path, *, workers: int | None = None, chunk_bytes: str = "64MB",
                 overwrite: bool = False, splits: tuple[str, ...] = ("train", "val", "test"), seed: int = 0,
                 image_column: str | None = None, label_column: str | None = None,
                 layout: str | None = None) -> dict[str, Any]:
    """Convert ``root/{train,val[,test]}/<class>/<images>`` (or ``root/{train,val[,test]}.csv`` manifests, one label
    or several per image; or a Hugging Face dataset: a ``save_to_disk`` folder, or ``hf:NAME`` from the cache, its
    columns found as ``HFDataModule`` finds them; or images and masks: ``root/images/<split>`` beside
    ``root/masks/<split>``, or another segmentation ``layout``) into litdata shards under ``out``, each split written
    in a random order drawn from ``seed`` (see the module docstring for why).

    Re-running on the same ``out`` resumes: complete splits are kept, an interrupted split continues from
    litdata's checkpoints. A finished ``out`` (or one started from other files) is refused unless
    ``overwrite``. Returns what ``vitkit_dataset.json`` records."""
    out = Path(os.path.expanduser(out)).resolve()
    source = Path(os.path.expanduser(str(root))).resolve()
    if layout is None and (source / "images").is_dir() and (source / "masks").is_dir():
        layout = "folder"  # images and masks
    if layout is not None:
        root, classes, multi, inputs, dataset = str(source), [], False, _mask_inputs(source, splits, seed, layout), None
    else:
        root, classes, multi, inputs, dataset = _conversion_inputs(root, splits, seed, image_column, label_column)
    started = {"format": FORMAT, "root": root, "classes": classes, "seed": seed,
               "files": {s: [rel for rel, _, _ in items] for s, items in inputs.items()}}
    workers = _check_output(out, started, workers, overwrite)
    workers = workers or os.cpu_count() or 1
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / INPUTS, {**started, "workers": workers})

    summary: dict[str, Any] = {"format": FORMAT, "root": root, "classes": classes, "order": "shuffled",
                               "seed": seed, "splits": {}, "multi_label": multi,
                               **({"masks": True, "layout": layout} if layout is not None else {})}
    for split, items in inputs.items():
        dest, skipped_log = out / split, out / f"{split}.skipped.tsv"
        if not (dest / "index.json").exists():  # not finished: (re)start it, from litdata's checkpoints if any
            log.info("%s: converting %d files with %d workers", split, len(items), workers)
            convert = partial(_convert_one, root=root, skipped_log=str(skipped_log), dataset=dataset,
                              masks=layout is not None)
            _optimize(convert, items, dest, skipped_log, workers, chunk_bytes)
        skipped = _read_skipped(skipped_log)
        n = json_samples(dest)
        if n + len(skipped) != len(items):
            raise RuntimeError(f"{split}: {n} samples written and {len(skipped)} skipped, but {len(items)} files were "
                               f"listed; the conversion in {dest} is inconsistent, run again with --overwrite")
        summary["splits"][split] = {"samples": n, "skipped": len(skipped)}
        for rel, why in skipped[:20]:
            log.warning("%s: skipped unreadable %s (%s)", split, rel, why)
        if skipped:
            log.warning("%s: %d unreadable file(s) left out; the full list is in %s", split, len(skipped), skipped_log)
    if multi:  # for pos_weight, which a stream cannot count: the rows written, not those left out
        left_out = {rel for rel, _ in _read_skipped(out / "train.skipped.tsv")}
        kept = [label for rel, label, _ in inputs["train"] if rel not in left_out]
        summary["label_counts"] = (np.sum(kept, axis=0) if kept else np.zeros(len(classes), int)).tolist()
    _write_json(out / MARKER, summary)  # last: from here on the dataset is complete
    return summary


def _optimize(convert, items: list, dest: Path, skipped_log: Path, workers: int, chunk_bytes: str) -> None:
    """litdata writes one split (its list of skipped files begun anew, unless litdata resumes the split)."""
    import litdata

    if not (dest / ".checkpoints").exists():
        skipped_log.unlink(missing_ok=True)
    skipped_log.touch()
    start_method = multiprocessing.get_start_method()
    try:
        litdata.optimize(fn=convert, inputs=items, output_dir=str(dest), chunk_bytes=chunk_bytes, num_workers=workers,
                         use_checkpoint=True, verbose=True, start_method=START_METHOD)
    finally:  # litdata switches the whole process to spawn; data loaders started later expect the default
        multiprocessing.set_start_method(start_method, force=True)


def _check_output(out: Path, started: dict[str, Any], workers: int | None, overwrite: bool) -> int | None:
    """Refuse an output folder that a new conversion must not write into, before anything is written; an
    unfinished conversion of the same files resumes with the worker count it started with (returned)."""
    if overwrite and out.exists():
        shutil.rmtree(out)
    if (out / MARKER).exists():
        raise ExistingFileError(f"{out} already holds a complete converted dataset ({MARKER}); pass --overwrite to "
                                "convert again, or choose another output folder")
    if out.exists() and any(out.iterdir()):
        if not (out / INPUTS).exists():
            raise ExistingFileError(f"{out} is not empty and was not started by prepare-data; choose an empty or new "
                                    "folder, or pass --overwrite to delete what is there")
        recorded_inputs = json.loads((out / INPUTS).read_text())
        if recorded_inputs.get("format") != FORMAT:
            raise ExistingFileError(f"{out} holds an unfinished conversion by an earlier vitkit, which wrote the files "
                                    "class after class; pass --overwrite to convert again in a shuffled order")
        if {k: v for k, v in recorded_inputs.items() if k != "workers"} != started:
            raise ExistingFileError(f"{out} holds an unfinished conversion of other files (another root, classes, "
                                    "file list or seed); pass --overwrite to start again, or choose another output "
                                    "folder")
        recorded = recorded_inputs.get("workers")
        if workers not in (None, recorded):
            log.warning("resuming with the %d workers the conversion started with (litdata's checkpoints are per "
                        "worker), not %d", recorded, workers)
        workers = recorded
        log.info("resuming the unfinished conversion in %s", out)
    return workers


def _read_skipped(path: Path) -> list[tuple[str, str]]:
    if not path.exists():
        return []
    rows = [line.split("\t", 1) for line in path.read_text().splitlines() if line]
    return sorted({(r[0], r[1] if len(r) > 1 else "") for r in rows})  # a resumed worker may retry a file


def json_samples(split_dir: Path) -> int:
    """Number of samples in a finished litdata dataset, from its index.json."""
    index = json.loads((split_dir / "index.json").read_text())
    return sum(c["chunk_size"] for c in index["chunks"])


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def read_dataset_info(location: str) -> dict[str, Any]:
    """``vitkit_dataset.json`` of a converted dataset: a local folder, or an object-store URL read by litdata.

    A dataset written class after class (format 1, before the shuffled write) is refused: streamed, its batches
    would hold one or two classes each, and a model trained on them stays at chance."""
    info = _read_marker(location)
    if info.get("format", 1) < 2:
        raise UsageError(
            f"{location} was converted by an earlier vitkit, which wrote each split class after class: streamed "
            "batches would hold one or two classes each and training would stay at chance. Convert it again, "
            f"in a shuffled order: `vitkit prepare-data {info.get('root', 'IMAGE_ROOT')} {location} --overwrite`")
    if info["format"] > FORMAT:
        raise UsageError(f"{location} was written in dataset format {info['format']} by a newer vitkit; this one "
                         f"reads format {FORMAT}: upgrade vitkit")
    return info


def _read_marker(location: str) -> dict[str, Any]:
    if "://" not in location:
        path = Path(os.path.expanduser(location)) / MARKER
        if not path.exists():
            folder = path.parent
            if (folder / INPUTS).exists():
                raise MissingFileError(f"{folder} is an unfinished conversion (no {MARKER}); run the same "
                                       f"`vitkit prepare-data IMAGE_ROOT {folder}` again to finish it")
            hint = (f"; it looks like an image folder: convert it with `vitkit prepare-data {folder} OUT`, or read "
                    "it as it is with ImageFolderDataModule") if (folder / "train").is_dir() else ""
            raise MissingFileError(f"{folder} is not a converted dataset (no {MARKER}); write one with "
                                   f"`vitkit prepare-data IMAGE_ROOT OUT`{hint}")
        return json.loads(path.read_text())
    import fsspec  # object stores through their fsspec filesystems (s3fs, gcsfs, adlfs), as the user installed them

    url = location.rstrip("/") + "/" + MARKER
    try:
        with fsspec.open(url, "rb") as f:
            return json.load(f)
    except Exception as e:
        raise MissingFileError(f"cannot read {url} ({type(e).__name__}: {e}); a dataset written by `vitkit "
                               "prepare-data` and uploaded whole has it") from e
