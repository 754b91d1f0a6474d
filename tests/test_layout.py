"""The size rules of the house (../shared/STYLE.md): no function over 60 lines, files in layers/ under about 300
lines and in models/ under about 500. A file past that holds two concepts."""

import ast
from pathlib import Path

import vitkit

PACKAGE = Path(vitkit.__file__).resolve().parent
FILE_LIMITS = {"layers": 300, "models": 500}


def test_no_function_is_longer_than_60_lines():
    long = [f"{p.relative_to(PACKAGE)}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for p in sorted(PACKAGE.rglob("*.py")) for n in ast.walk(ast.parse(p.read_text()))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 60]
    assert not long, long


def test_layer_and_model_files_stay_small():
    big = [f"{p.relative_to(PACKAGE)} ({len(p.read_text().splitlines())} lines, limit {limit})"
           for room, limit in FILE_LIMITS.items() for p in sorted((PACKAGE / room).glob("*.py"))
           if len(p.read_text().splitlines()) > limit]
    assert not big, big


def test_bad_input_takes_one_path_to_the_command_line():
    """Below the command line, bad input raises vitkit.errors.UsageError (or another error vitkit.errors knows);
    only vitkit.cli.guarded turns it into the `error:` line and the exit status. No module raises SystemExit."""
    raised = [f"{p.relative_to(PACKAGE)}:{n.lineno}" for p in sorted(PACKAGE.rglob("*.py"))
              for n in ast.walk(ast.parse(p.read_text()))
              if isinstance(n, ast.Raise) and n.exc is not None
              and "SystemExit" in ast.unparse(n.exc.func if isinstance(n.exc, ast.Call) else n.exc)]
    assert not raised, raised


def test_no_room_holds_more_than_a_fifth_of_the_house():
    """A room (a folder or file directly under vitkit/) over 20 % of the package's lines does several jobs."""
    lines: dict[str, int] = {}
    for p in PACKAGE.rglob("*.py"):
        room = p.relative_to(PACKAGE).parts[0]
        lines[room] = lines.get(room, 0) + len(p.read_text().splitlines())
    total = sum(lines.values())
    big = {room: f"{n / total:.0%}" for room, n in lines.items() if n > 0.2 * total}
    assert not big, big
