"""The help of ``vitkit train`` and ``vitkit evaluate``, kept on disk after the first time it is shown.

Those two list LightningCLI's arguments, and jsonargparse builds them from the classes themselves: torch, Lightning
and every data module imported, several seconds before a line is printed. What they print depends only on the
command line and its folder, the width of the terminal, the files the command line names (a config), vitkit's own
files (its code and recipes) and the versions of the libraries that make the parser; all of it goes into the key,
so a changed recipe, an upgraded Lightning or an edited config shows a fresh help. The folder is
``$VITKIT_CACHE/help`` (default ``~/.cache/vitkit/help``); a cache that cannot be read or written is skipped, never
an error.

The first time is answered too: the plain forms (``vitkit train [fit|validate|test|predict] --help``,
``vitkit evaluate --help``) ship with vitkit in ``help-texts/``, printed at 80 columns with the libraries whose
versions ``made_with.json`` records. They are shown where those versions and Python's are the ones installed and the
terminal is at least that wide; elsewhere the help is made as above. ``python -m vitkit.cli.help_cache`` writes them
again, and the suite compares them with the help the parser prints.
"""

from __future__ import annotations

import hashlib
import io
import json
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
SHIPPED = Path(__file__).with_name("help-texts")
SHIPPED_FORMS = (("train",), ("train", "fit"), ("train", "validate"), ("train", "test"), ("train", "predict"),
                 ("evaluate",))
SHIPPED_COLUMNS = 80


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


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "-"


def made_with() -> dict[str, str]:
    """What the help's text depends on besides vitkit's own files: Python's version (argparse's layout) and the
    libraries' (the classes whose arguments it lists)."""
    python = ".".join(map(str, sys.version_info[:2]))
    return {"python": python, **{n: _version(n) for n in LIBRARIES if n != "vitkit"}}


def _form(argv: list[str]) -> tuple[str, ...] | None:
    """The shipped form ``argv`` asks for (``train fit --help`` -> ``("train", "fit")``), or None."""
    if not argv or argv[-1] not in ("-h", "--help"):
        return None
    return tuple(argv[:-1]) if tuple(argv[:-1]) in SHIPPED_FORMS else None


def shipped(argv: list[str]) -> str | None:
    """The help of ``vitkit ARGV`` as it ships in ``help-texts/``, where it is the one the parser would print here."""
    form = _form(argv)
    if form is None or shutil.get_terminal_size().columns < SHIPPED_COLUMNS:
        return None
    try:
        if json.loads((SHIPPED / "made_with.json").read_text()) != made_with():
            return None
        return (SHIPPED / f"{'_'.join(form)}.txt").read_text()
    except (OSError, ValueError):
        return None


def key(argv: list[str]) -> str:
    """A digest of everything the help printed for ``argv`` depends on."""
    h = hashlib.sha256()
    h.update(repr((argv, os.getcwd(), shutil.get_terminal_size().columns, sys.version)).encode())
    for name in LIBRARIES:
        h.update(f"{name}={_version(name)};".encode())
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
    """Print the help of ``vitkit ARGV``: as it ships, from the cache, or from ``run()``, kept for next time where
    the parser printed it and exited with status 0 (a command that ran instead, returning, is not kept)."""
    text = shipped(argv)
    if text is not None:
        sys.stdout.write(text)
        return 0
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


def render(argv: list[str]) -> str:
    """The help the parser prints for ``vitkit ARGV``, made now at ``SHIPPED_COLUMNS`` columns."""
    from vitkit.cli import command

    out, columns = io.StringIO(), os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(SHIPPED_COLUMNS)
    try:
        with redirect_stdout(out):
            command(argv[0]).main(argv[1:])
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    finally:
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns
    return out.getvalue()


def write_shipped(folder: Path = SHIPPED) -> None:
    """Make the shipped helps again, with the libraries installed now (after an upgrade, or a changed argument)."""
    folder.mkdir(exist_ok=True)
    for form in SHIPPED_FORMS:
        (folder / f"{'_'.join(form)}.txt").write_text(render([*form, "--help"]))
    (folder / "made_with.json").write_text(json.dumps(made_with(), indent=1) + "\n")


if __name__ == "__main__":
    write_shipped()
    print(f"wrote {len(SHIPPED_FORMS)} helps to {SHIPPED}, made with {made_with()}")
