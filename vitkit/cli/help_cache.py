"""The help of ``vitkit train`` and ``vitkit evaluate``, kept on disk after the first time it is shown.

Those two list LightningCLI's arguments, and jsonargparse builds them from the classes themselves: torch, Lightning
and every data module imported, several seconds before a line is printed. What they print depends only on the
command line and its folder, the width of the terminal, the files the command line names (a config), vitkit's own
files (its code and recipes) and the versions of the libraries that make the parser; all of it goes into the key,
so a changed recipe, an upgraded Lightning or an edited config shows a fresh help. The folder is
``$VITKIT_CACHE/help`` (default ``~/.cache/vitkit/help``); a cache that cannot be read or written is skipped, never
an error.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from contextlib import redirect_stdout
from importlib import metadata
from pathlib import Path

CACHED = ("train", "evaluate")  # the subcommands whose help needs Lightning
LIBRARIES = ("lightning", "jsonargparse", "torch", "torchvision", "timm", "litdata", "datasets", "vitkit")


def cache_dir() -> Path:
    root = os.environ.get("VITKIT_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "vitkit")
    return Path(root).expanduser() / "help"


def asks_for_help(argv: list[str]) -> bool:
    """Whether ``vitkit NAME ARGS`` only prints a help: ``-h``, ``--help`` or jsonargparse's ``--X.help CLASS``."""
    return bool(argv) and argv[0] in CACHED and any(
        a in ("-h", "--help") or (a.startswith("--") and a.split("=", 1)[0].endswith(".help")) for a in argv[1:])


def _sources() -> list[Path]:
    from vitkit.recipes import recipes_dir

    package = Path(__file__).resolve().parents[1]
    try:
        recipes = sorted(recipes_dir().glob("*.yaml"))
    except FileNotFoundError:
        recipes = []
    return sorted(package.rglob("*.py")) + recipes


def key(argv: list[str]) -> str:
    """A digest of everything the help printed for ``argv`` depends on."""
    h = hashlib.sha256()
    h.update(repr((argv, os.getcwd(), shutil.get_terminal_size().columns, sys.version)).encode())
    for name in LIBRARIES:
        try:
            h.update(f"{name}={metadata.version(name)};".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{name}=-;".encode())
    for path in _sources():
        st = path.stat()
        h.update(f"{path}:{st.st_mtime_ns}:{st.st_size};".encode())
    for arg in argv:  # a config file (or any file) the command line names: by its content
        for part in (arg, arg.split("=", 1)[-1]):
            try:
                if os.path.isfile(part):
                    h.update(Path(part).read_bytes())
            except OSError:
                pass
    return h.hexdigest()[:32]


def show(argv: list[str], run: Callable[[], int]) -> int:
    """Print the help of ``vitkit ARGV``: from the cache, or from ``run()``, kept for next time where the parser
    printed it and exited with status 0 (a command that ran instead, returning, is not kept)."""
    path: Path | None = None
    try:
        path = cache_dir() / f"{key(argv)}.txt"
        sys.stdout.write(path.read_text())
        return 0
    except OSError:
        pass
    out = io.StringIO()
    try:
        with redirect_stdout(out):
            code = run()
    except SystemExit as e:
        sys.stdout.write(out.getvalue())
        if e.code not in (0, None):
            raise
        if out.getvalue() and path is not None:  # the parser printed a help and exited
            _write(path, out.getvalue())
        return 0
    sys.stdout.write(out.getvalue())
    return code


def _write(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            f.write(text)
        os.replace(f.name, path)
    except OSError:
        pass
