"""Reading and writing weight files safely: no pickle ever runs code, and no write is ever torn."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import pickle
import re
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors.torch import load_file, save_file

from vitkit.errors import CheckpointError

T = TypeVar("T")

# Plain-data classes found in training checkpoints that ``weights_only`` refuses by default; rebuilding
# them sets attributes and nothing else (timm and DeiT save their argparse Namespace as ``args``).
SAFE_GLOBALS = [argparse.Namespace, pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath]

# Weight files looked for in a folder, in order of preference (safetensors first).
WEIGHT_NAMES = ("model.safetensors", "pytorch_model.bin", "model.pth", "model.pt", "model.bin")
WEIGHT_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin", ".ckpt")




class UnsafeCheckpointError(CheckpointError):
    """A pickle that would import and call arbitrary objects; it was refused before anything ran."""


def resolve(path: str | os.PathLike) -> tuple[Path, dict | None]:
    """The weight file behind ``path`` and the ``config.json`` beside it (for a folder), if any; a sharded
    checkpoint's folder is its own weight file. ``~`` is the home folder, as in a data root."""
    path = Path(os.path.expanduser(path))
    if not path.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    if path.is_file() or is_sharded(path):
        return path, None
    config = read_config(path) if (path / "config.json").is_file() else None
    for name in WEIGHT_NAMES:
        if (path / name).is_file():
            return path / name, config
    found = sorted(p.name for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES)
    if len(found) == 1:
        return path / found[0], config
    raise CheckpointError(f"folder {str(path)!r} holds no single weight file: expected one of {list(WEIGHT_NAMES)}"
                          f"{f', found several: {found}' if found else ', found none'}")


def read_config(folder: Path) -> dict:
    """A folder's ``config.json`` as a dict, or a :class:`CheckpointError` naming it (not JSON, not an object)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (ValueError, RecursionError) as e:  # JSON, UTF-8, nesting too deep
        raise CheckpointError(f"{folder / 'config.json'} is not valid JSON: {_first_line(e)}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{folder / 'config.json'} holds a JSON {type(config).__name__}, expected an object")
    return config


def interpreted(where: Path | str, read: Callable[[], T]) -> T:
    """``read()`` (the reading of another library's file into vitkit's settings and names), where an error that
    the file's own content causes (a key missing, a value of the wrong type or size, settings vitkit's model
    refuses) is the file's: a :class:`CheckpointError` naming it."""
    try:
        return read()
    except CheckpointError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, RuntimeError) as e:
        raise CheckpointError(f"{where}: its content does not describe a model vitkit reads ({_first_line(e)})") \
            from None


def _is_torchscript(path: Path) -> bool:
    """A ``torch.jit.save`` archive: a zip with the module's code (``*/code/``) beside its pickled state.

    A file whose zip listing does not read is not one; torch's reader then names what is wrong with it. zipfile
    raises more than ``BadZipFile`` on damaged bytes (``UnicodeDecodeError`` for a name whose UTF-8 flag a
    flipped bit set, ``NotImplementedError``, ``struct.error``, ``EOFError``, ``ValueError``), so any error counts."""
    try:
        with zipfile.ZipFile(path) as z:
            return any("/code/" in n or n.startswith("code/") for n in z.namelist())
    except Exception:  # noqa: BLE001 - see the docstring
        return False


def read_file(path: Path) -> dict[str, Any]:
    """Load a ``.safetensors`` file or a ``torch.save`` file of tensors and plain containers, on CPU.

    Pickles go through ``torch.load(weights_only=True)``: a file that would import anything other than
    tensors, containers and :data:`SAFE_GLOBALS` is refused, and its code never runs. Whatever bytes the file
    holds, what comes out is a dict or a :class:`CheckpointError` that names the file."""
    try:
        return _read_file(path)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - a reader's own error on bad bytes, of any type, named once
        raise CheckpointError(f"{path} is not a readable checkpoint (truncated or corrupt?): {_first_line(e)}") \
            from None


def _read_file(path: Path) -> dict[str, Any]:
    if path.suffix == ".safetensors":
        try:
            return load_file(path, device="cpu")
        except Exception as e:  # whatever the parser raises on bad bytes, the user gets one named error
            raise CheckpointError(f"{path} is not a readable safetensors file (truncated or corrupt?): "
                                  f"{_first_line(e)}") from None
    if _is_torchscript(path):
        raise UnsafeCheckpointError(
            f"{path} is a TorchScript archive (as OpenAI's CLIP .pt files are): reading it means running its code, "
            "which vitkit does not do. Where you trust it, save its weights as a state dict "
            "(`torch.save(torch.jit.load(path).state_dict(), 'weights.pth')`) and load that; OpenCLIP's and timm's "
            "files of the same weights load as they are.")
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL:? ?([\w.]+)", str(e))
        if found:
            raise UnsafeCheckpointError(
                f"refused to load {path}: its pickle asks to import and call {found.group(1)}, which can run "
                "arbitrary code; nothing from it was executed. If you trust the file, convert it to .safetensors "
                "where you trust it, or allow that one class with torch.serialization.add_safe_globals."
            ) from None
        raise CheckpointError(f"{path} is not a readable checkpoint (corrupt pickle: "
                              f"{str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__})") from None
    except Exception as e:  # torch, zipfile, pickle and struct each raise their own types on bad bytes
        raise CheckpointError(f"{path} is not a readable checkpoint (truncated or corrupt?): "
                              f"{_first_line(e)}") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path} holds a {type(obj).__name__}, expected a dict of tensors (a state_dict)")
    return obj


def is_sharded(path: Path) -> bool:
    """A folder of torch's distributed checkpoint (``.metadata`` and one ``*.distcp`` shard file per rank), read by
    :func:`vitkit.checkpoints.sharded.read_sharded`."""
    return path.is_dir() and (path / ".metadata").is_file()


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def atomic_write(path: Path, write) -> None:
    """Call ``write(tmp_path)`` and rename the result over ``path``; a crash leaves the old file intact. The file
    gets the permissions any new file gets here (the umask's, as ``open`` gives), not the temporary file's 0600."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_safetensors(state_dict: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    tensors = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))


def write_json(obj: dict, path: Path) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=2) + "\n"))
