"""The manual: README stays short, the site builds with mkdocs --strict (no broken link, page or reference), the
Python blocks marked runnable run, and every `vitkit ...` / `python train.py ...` command shown parses, with the
flags it shows, against the command's own parser."""

import re
import shlex
import sys
from pathlib import Path

import pytest

from tests import forkserver

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RUNNABLE = re.compile(r"<!-- runnable -->\s*```python\n(.*?)```", re.S)
PYTHON = re.compile(r"(<!-- (?:runnable|tested by (\S+)) -->\s*)?```python\n(.*?)```", re.S)
BASH = re.compile(r"```bash\n(.*?)```", re.S)


LAUNCHER = re.compile(r"^(?:[A-Z_]+=\S+\s+)*(?:srun\s+|torchrun(?:\s+--?[\w-]+(?:[ =](?!\S*train\.py)\S+)?)*\s+)?")


def _commands(text: str) -> list[str]:
    """The vitkit and train.py command lines of the bash blocks (continuations joined, comments dropped), also
    under a launcher (``srun``, ``torchrun ... train.py``, environment variables before them), as the command
    itself (``vitkit ...`` or ``python train.py ...``)."""
    out = []
    for block in BASH.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip().removeprefix("$ ")
            line = re.sub(r"\s+#.*$", "", line)
            for part in line.split("&&"):
                part = LAUNCHER.sub("", part.strip(), count=1)
                if part.startswith("train.py "):  # torchrun runs the script itself
                    part = "python " + part
                if part.startswith(("vitkit ", "python train.py ")):
                    out.append(part)
    return out


COMMANDS = [(page.relative_to(ROOT).as_posix(), cmd) for page in PAGES for cmd in _commands(page.read_text())]


def test_readme_stays_under_200_lines():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


@pytest.mark.slow
def test_the_site_builds_strict(tmp_path):
    # forked from the tests' prepared interpreter: the build's hooks import vitkit's commands (torch, Lightning)
    # not -q: mkdocs -q drops the warnings before --strict counts them, and the build passes with them
    done = forkserver.run(["-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")], cwd=ROOT,
                          env={"NO_MKDOCS_2_WARNING": "1", **_env()}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "WARNING" not in done.stderr, done.stderr[-3000:]
    cli = (tmp_path / "site/reference/cli/index.html").read_text()
    assert "vitkit evaluate" in cli and "vitkit prepare-data" in cli  # written from the commands' own --help
    assert "ImageClassifier" in (tmp_path / "site/reference/api/index.html").read_text()


def _env() -> dict:
    import os

    return dict(os.environ)


@pytest.mark.parametrize("page, code", [(p.relative_to(ROOT).as_posix(), c) for p in PAGES
                                        for c in RUNNABLE.findall(p.read_text())])
def test_the_runnable_python_blocks_run(page, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(code, page, "exec"), {"__name__": "__docs__"})


def test_every_python_block_runs_here_or_names_the_test_that_runs_it():
    """Each Python block of the manual either runs in the suite as it stands (``<!-- runnable -->``: the test above)
    or needs what a test builds (weights from the hub cache, a trained checkpoint, an int8 program) and names that
    test (``<!-- tested by tests/PATH.py::test_name -->``), which must exist."""
    loose, gone = [], []
    for page in PAGES:
        for marker, tested_by, code in PYTHON.findall(page.read_text()):
            where = f"{page.relative_to(ROOT)}: {code.splitlines()[0]}"
            if not marker:
                loose.append(where)
            elif tested_by:
                path, _, name = tested_by.partition("::")
                if not (ROOT / path).is_file() or f"def {name}(" not in (ROOT / path).read_text():
                    gone.append(f"{where} -> {tested_by}")
    assert not loose, f"Python blocks neither runnable nor tested by a named test: {loose}"
    assert not gone, f"Python blocks naming tests that are not there: {gone}"


def test_the_tests_the_pages_name_are_there():
    """A test a page names (``tests/PATH.py`` or ``tests/PATH.py::test_name``) exists, under that name."""
    missing = []
    for page in [*PAGES, *sorted((ROOT / "configs").glob("*.yaml"))]:
        for path, name in re.findall(r"(?<![\w/])(tests/[\w/]+\.py)(?:::(\w+))?", page.read_text()):
            if not (ROOT / path).is_file() or (name and f"def {name}(" not in (ROOT / path).read_text()):
                missing.append(f"{page.name}: {path}{'::' + name if name else ''}")
    assert not missing, missing


def _parse_train(args: list[str]) -> None:
    from vitkit.cli.train import VitkitCLI

    class ParseOnly(VitkitCLI):
        def instantiate_classes(self) -> None:  # the types are checked by parsing; nothing is built or run
            pass

        def _run_subcommand(self, subcommand: str) -> None:
            pass

    ParseOnly(args=args)


def _parse(cmd: str) -> None:
    words = [w.replace("$RUN", "runs/digits_demo/1") for w in shlex.split(cmd)]
    if words[0] == "python":
        return _parse_train(words[2:])
    rest = words[1:]
    if rest[0] == "train":
        return _parse_train(rest[1:])
    from vitkit.cli import COMMANDS as SUBCOMMANDS
    from vitkit.cli import command, parser

    if rest[0] not in SUBCOMMANDS:
        parser().parse_args(rest)  # --help, or an error naming the subcommands
        return None
    module = command(rest[0])
    getattr(module, "parse_args", lambda argv: module.parser().parse_args(argv))(rest[1:])
    return None


@pytest.mark.slow
@pytest.mark.parametrize("page, cmd", COMMANDS)
def test_every_command_shown_parses(page, cmd, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["vitkit"])
    try:
        _parse(cmd)
    except SystemExit as e:
        pytest.fail(f"{page}: `{cmd}` does not parse (exit {e.code})")


def test_the_pages_show_commands():
    assert len(COMMANDS) >= 40, len(COMMANDS)


def test_the_architecture_page_names_every_module():
    """docs/architecture.md describes the tree as it is: every module of the package is in a row, by its path, or
    by its file name in a row whose first cell names its package."""
    rows = [(line.split("|")[1], line) for line in (ROOT / "docs/architecture.md").read_text().splitlines()
            if line.startswith("| `")]
    missing = []
    for f in sorted((ROOT / "vitkit").rglob("*.py")):
        if f.name == "__init__.py":
            continue
        path, package = f.relative_to(ROOT).as_posix(), f.parent.relative_to(ROOT).as_posix() + "/"
        if not any(f"`{path}`" in first or (f"`{package}" in first and f"`{f.name}`" in row) for first, row in rows):
            missing.append(path)
    assert not missing, f"docs/architecture.md has no row for {missing}"


def _globs(cell: str) -> list[str]:
    """The preset globs a family's row names: `a_{x,y}` is two, and an ending (`_qkvb`, `_rope_ape_224`) stands
    for the glob before it with its tail from that ending's first part on replaced (or the ending added)."""
    out: list[str] = []
    for glob in re.findall(r"`([^`]+)`", cell):
        if glob.startswith("_") and out:
            head = "_" + glob.split("_")[1]
            glob = (out[-1][: out[-1].index(head)] if head in out[-1] else out[-1]) + glob
        braces = re.search(r"\{([^}]*)\}", glob)
        out += [glob[: braces.start()] + alt + glob[braces.end():] for alt in braces.group(1).split(",")] \
            if braces else [glob]
    return out


def test_the_family_table_counts_the_presets_its_globs_match():
    import fnmatch

    import vitkit

    presets = vitkit.list_models()
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in (ROOT / "docs/models.md").read_text().splitlines()
            if line.startswith("| ") and line.count("|") > 4]
    counted = [(row[0], int(row[1]), len({p for p in presets for g in _globs(row[0]) if fnmatch.fnmatch(p, g)}))
               for row in rows if row[1].isdigit()]
    assert len(counted) >= 8 and all(said == found for _, said, found in counted), counted
