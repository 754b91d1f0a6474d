"""Sharded checkpoints (torch's distributed checkpoint, what FSDP2 and Lightning's ``ModelParallelStrategy`` write)
read into one dict on CPU, as safely as any other file.

torch's own conversion (``dcp_to_torch_save``) unpickles the ``.metadata`` file with plain ``pickle`` and every
non-tensor item of the shards with ``torch.load(weights_only=False)``: either can run code. Here the metadata is
unpickled with only torch's checkpoint classes allowed, its sizes are checked against the shard files before anything
is allocated (a damaged size would otherwise ask for more memory than the machine has), and the non-tensor items
are read with ``weights_only=True``. The reading itself is torch's, through its public reader and planner classes.
"""

from __future__ import annotations

import io
import math
import pickle
import pickletools
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from vitkit.errors import UsageError

from .files import SAFE_GLOBALS, CheckpointError, UnsafeCheckpointError, read_file

# What a ``.metadata`` pickle may import: torch's checkpoint metadata classes and the few torch and pathlib names
# they hold (checked on torch 2.14.1).
_DCP_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                ("pathlib", "WindowsPath"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if not (module.startswith("torch.distributed.checkpoint.") or (module, name) in _DCP_GLOBALS or dtype):
            raise UnsafeCheckpointError(f"refused to load {self.path}: its pickle asks to import and call "
                                        f"{module}.{name}, which no checkpoint metadata holds and which can run "
                                        "arbitrary code (a damaged or a crafted file); nothing from it was executed")
        return super().find_class(module, name)


_MEMO_OPS = {"PUT", "BINPUT", "LONG_BINPUT", "GET", "BINGET", "LONG_BINGET"}


def _check_memo(data: bytes) -> None:
    """Refuse a pickle whose memo indices point past its own length, before it is unpickled: Python's unpickler
    grows its memo table to the index it is given, so one damaged byte (BUILD read as LONG_BINPUT) asked it for
    8 GiB. A pickle that a Pickler wrote numbers its memo entries in order."""
    for count, (op, arg, _) in enumerate(pickletools.genops(io.BytesIO(data)), 1):
        if op.name in _MEMO_OPS and (not isinstance(arg, int) or not 0 <= arg <= count):
            raise UsageError(f"memo index {arg} at opcode {count} ({op.name})")


def read_metadata(folder: Path) -> Metadata:
    """The folder's ``.metadata``, unpickled with torch's checkpoint classes only, and its sizes checked."""
    path = folder / ".metadata"
    try:
        data = path.read_bytes()
        _check_memo(data)
        meta = _MetadataUnpickler(io.BytesIO(data), path).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - pickle's many error types on bad bytes
        raise CheckpointError(f"{path} is not readable (truncated or corrupt?): {type(e).__name__}: {e}") from None
    if not isinstance(meta, Metadata) or not isinstance(getattr(meta, "state_dict_metadata", None), dict) \
            or not isinstance(getattr(meta, "storage_data", None), dict):
        raise CheckpointError(f"{path} holds a {type(meta).__name__}, not a distributed checkpoint's metadata")
    try:
        _check_sizes(meta, folder)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged field of an unexpected type
        raise CheckpointError(f"{path} is damaged: {type(e).__name__}: {e}") from None
    return meta


def _check_sizes(meta: Metadata, folder: Path) -> None:
    """Every stored item lies inside its shard file, and the tensors declared fit in the bytes the shards hold
    (each tensor is stored whole or in chunks, serialised with some overhead, unless a transform compressed it)."""
    sizes = {p.name: p.stat().st_size for p in folder.iterdir() if p.is_file()}
    compressed = False
    for info in meta.storage_data.values():
        if info.relative_path not in sizes:
            raise CheckpointError(f"{folder}: its metadata names the shard {info.relative_path!r}, which is missing")
        if not (0 <= info.offset and 0 <= info.length and info.offset + info.length <= sizes[info.relative_path]):
            raise CheckpointError(f"{folder}: an item of {info.relative_path} lies outside the file (bytes "
                                  f"{info.offset}-{info.offset + info.length} of {sizes[info.relative_path]}): torn "
                                  "or damaged")
        compressed |= bool(getattr(info, "transform_descriptors", None))
    declared = 0
    for key, item in meta.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            if not isinstance(item.properties.dtype, torch.dtype) or any(not isinstance(n, int) or n < 0
                                                                         for n in item.size):
                raise CheckpointError(f"{folder}: the metadata of {key!r} is damaged ({item.size}, "
                                      f"{item.properties.dtype})")
            declared += math.prod(item.size) * item.properties.dtype.itemsize
    stored = sum(info.length for info in meta.storage_data.values())
    if not compressed and declared > stored:
        raise CheckpointError(f"{folder}: its metadata declares {declared:,} bytes of tensors, but its shards store "
                              f"{stored:,}: the metadata is damaged")


class _Reader(FileSystemReader):
    """torch's file-system reader, given the metadata vitkit has already read and checked."""

    def __init__(self, folder: Path, meta: Metadata) -> None:
        super().__init__(folder)
        self._checked = meta

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if getattr(self._checked, "storage_meta", None) is None:
            self._checked.storage_meta = StorageMeta()
        self._checked.storage_meta.load_id = self.load_id
        return self._checked


class _Planner(DefaultLoadPlanner):
    """Rebuilds the whole state dict from the metadata (as torch's conversion does) and reads its non-tensor items
    with ``weights_only=True``."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = folder

    def set_up_planner(self, state_dict: dict, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        assert metadata is not None and not state_dict
        for key, item in metadata.state_dict_metadata.items():
            value = torch.empty(item.size, dtype=item.properties.dtype) if isinstance(item, TensorStorageMetadata) \
                else None
            path = (metadata.planner_data or {}).get(key, (key,))
            _set(state_dict, path, value)
        self.built = state_dict  # dcp.load hands the planner a dict of its own: this one is filled in place
        super().set_up_planner(state_dict, metadata, is_coordinator)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            with torch.serialization.safe_globals(SAFE_GLOBALS):
                obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            found = re.search(r"GLOBAL:? ?([\w.]+)", str(e))
            raise UnsafeCheckpointError(
                f"refused to load {self.folder}: its item {read_item.dest_index.fqn!r} asks to import and call "
                f"{found.group(1) if found else 'an object'}, which can run arbitrary code; nothing from it was "
                "executed") from None
        if self.flatten_state_dict:
            _set(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _set(root: dict, path: tuple, value: Any) -> None:
    """``root[path[0]][path[1]]... = value``, making the dicts (or lists, where the next key is an int) on the way."""
    node: Any = root
    for key, nxt in zip(path[:-1], path[1:], strict=True):
        if isinstance(node, list):
            node.extend([None] * (key + 1 - len(node)))
        if (node[key] is None) if isinstance(node, list) else (key not in node):
            node[key] = [] if isinstance(nxt, int) else {}
        node = node[key]
    if isinstance(node, list):
        node.extend([None] * (path[-1] + 1 - len(node)))
    node[path[-1]] = value


def read_sharded(folder: Path) -> dict[str, Any]:
    """Every rank's shards gathered into one dict on CPU, with Lightning's ``meta.pt`` (hyper-parameters, progress)
    merged in when it is there (read like any torch file)."""
    meta = read_metadata(folder)
    planner = _Planner(folder)
    try:
        dcp.load({}, storage_reader=_Reader(folder, meta), planner=planner, no_dist=True)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - torch's CheckpointException is a BaseException
        if isinstance(e, CheckpointException) and e.failures:  # one per rank: (error, its stack)
            e = next(iter(e.failures.values()))[0]
        if isinstance(e, CheckpointError):
            raise e from None
        raise CheckpointError(f"{folder} is not a readable sharded checkpoint (a shard missing or torn?): "
                              f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}") \
            from None
    state = planner.built
    if (folder / "meta.pt").is_file():
        state = {**read_file(folder / "meta.pt"), **state}
    return state
