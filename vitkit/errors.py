"""Which errors are about the user's input, and the one line each becomes on the command line.

vitkit's commands end bad input (an argument, a file, a config value, an override, a trainer this machine cannot
run) with ``error: ...`` and exit status 1; ``--traceback`` (or ``VITKIT_TRACEBACK=1``) shows the traceback instead.
Such input is what vitkit checked and refused with :class:`UsageError` or one of its kinds below (each also the
built-in error a Python caller expects: a :class:`MissingFileError` is a FileNotFoundError). Anything else, a
ValueError from inside vitkit included, is a fault to report and keeps its traceback. One place turns them into the
line: ``vitkit.cli.guarded``, by :func:`error_line`.
"""

from __future__ import annotations

import logging
import os

TRACEBACK_FLAG, TRACEBACK_ENV = "--traceback", "VITKIT_TRACEBACK"
VERBOSE_FLAG = "--verbose"


class UsageError(ValueError):
    """Input the user can change (an argument, a file, a config value), said in the words of the command line; the
    command ends with ``error: <message>`` and exit status 1. Raised wherever vitkit finds the fault, never printed
    there."""


class UsageTypeError(UsageError, TypeError):
    """A value of the wrong kind (an argument, a part, a tensor's dtype)."""


class MissingFileError(UsageError, FileNotFoundError):
    """A file or folder the user named that is not there, or lacks what it should hold."""


class ExistingFileError(UsageError, FileExistsError):
    """A file or folder in the way of what a command would write."""


class MissingPackageError(UsageError, ImportError):
    """An optional dependency a feature needs, with the ``pip install`` that adds it."""


class CheckpointError(UsageError):
    """A path that does not hold a readable checkpoint (missing, truncated, corrupt or of unknown layout)."""


def user_error(e: BaseException | None) -> BaseException | None:
    """The :class:`UsageError` inside ``e``, following what it was raised from (jsonargparse wraps whatever a class
    raises while it is built in a "Does not validate against any of the Union subtypes" error); None when ``e`` is
    not about the user's input."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, UsageError):
            return e
        e = e.__cause__ or e.__context__
    return None


def one_line(e: BaseException) -> str:
    """``error: <message>``, the message on one line (a long listing keeps its first lines, joined)."""
    lines = str(e).strip().splitlines()
    if lines and lines[0].startswith("Caught ") and "Original Traceback" in str(e):  # raised in a loader's worker:
        last = lines[-1].strip()  # torch re-raises it with the worker's traceback; its own line is the last
        lines = [last.partition(": ")[2] or last]
    text = " ".join(line.strip() for line in lines[:6] if line.strip()) or type(e).__name__
    return text if text.startswith("error:") else f"error: {text}"


def error_line(e: BaseException, argv: list[str] | None = None) -> str | None:
    """The one line that ends a command for ``e``: ``error: ...`` where ``e`` (or what it was raised from) is about
    the user's input; None where it is a fault to report with its traceback, or a traceback is asked for."""
    cause = user_error(e)
    return None if cause is None or wants_traceback(argv) else one_line(cause)


def wants_traceback(argv: list[str] | None = None) -> bool:
    """Whether the command line (``argv``) or the environment asks for tracebacks."""
    return TRACEBACK_FLAG in (argv or []) or os.environ.get(TRACEBACK_ENV, "") not in ("", "0")


def take_traceback_flag(argv: list[str]) -> list[str]:
    """``argv`` without ``--traceback``; given, it sets ``VITKIT_TRACEBACK=1``, which the processes a multi-device
    run starts inherit."""
    if TRACEBACK_FLAG in argv:
        os.environ[TRACEBACK_ENV] = "1"
    return [a for a in argv if a != TRACEBACK_FLAG]


def take_verbose_flag(argv: list[str]) -> list[str]:
    """``argv`` without ``--verbose``; given, vitkit's own log shows its DEBUG lines (the paths of skipped files,
    the attention path each kind of call runs), in this process and the loader workers it forks, and the other
    libraries' lines that vitkit's commands hide (``vitkit/library_output.py``): ``VITKIT_VERBOSE=1``, which the
    processes a multi-device run starts inherit."""
    if VERBOSE_FLAG in argv:
        os.environ["VITKIT_VERBOSE"] = "1"
        logger = logging.getLogger("vitkit")
        logger.setLevel(logging.DEBUG)
        if not logger.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
            logger.addHandler(handler)
    return [a for a in argv if a != VERBOSE_FLAG]
