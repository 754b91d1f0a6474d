"""The `vitkit` command run as the shell runs it, in this process, and the one-error-line rule its bad input
follows (``vitkit/errors.py``)."""

import io
import sys
from contextlib import redirect_stderr

from vitkit.cli import main


def run_cli(argv: list[str], capture) -> tuple[int, str]:
    """(exit status, what it wrote to stderr); ``capture`` is pytest's capsys or capfd."""
    try:
        status = main(argv)
    except SystemExit as e:  # the shell prints a message given to SystemExit, and exits with 1
        status = e.code if isinstance(e.code, int) or e.code is None else 1
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    return status or 0, capture.readouterr().err


def one_error_line(status: int, err: str) -> str:
    """The one ``error:`` line of a refused command (exit status 1, no traceback)."""
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert status == 1, (status, err)
    assert "Traceback" not in err, err
    errors = [line for line in lines if line.startswith("error:") or ": error: " in line]
    assert len(errors) == 1, err
    return errors[0]


def error_line_of(argv: list[str]) -> str:
    """The one ``error:`` line that ``vitkit ARGV``, run in this process, ends with."""
    err = io.StringIO()
    with redirect_stderr(err):
        status = main(argv)
    return one_error_line(status, err.getvalue())
