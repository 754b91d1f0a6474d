"""What other libraries print in every run that is no news about the user's run, kept out of vitkit's commands.

Each line below was printed by every run of some recipe, whatever the data: Lightning's advertisements, its note on
the checkpoint it writes, its warnings about a logging interval longer than a small epoch and about modules that
vitkit keeps in eval mode on purpose (DINO's teacher, a frozen backbone), the model summary's remark on mixed
precision, torchmetrics' remark on a validation batch without an image of some class, a deprecation inside Lightning
and one inside torchdata, what importing torchao (also through peft, for LoRA) and compiling an int8 program on a
CPU log (export ``--int8`` to a .pt2), the ONNX exporter's remark on an axis that several inputs share
(``--packed``), and Lightning's caution about an iterable dataset with a length (litdata's loaders split it among
their workers). ``--verbose`` (or ``VITKIT_VERBOSE=1``) shows them again, with vitkit's own DEBUG lines.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

VERBOSE_ENV = "VITKIT_VERBOSE"

WARNINGS = (  # regular expressions matched at the start of the warning's message
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",  # raised inside Lightning
    r"The number of training batches \(\d+\) is smaller than the logging interval",
    r"Found \d+ module\(s\) in eval mode at the start of training",
    r"Precision \S+ is not supported by the model summary",
    r"No positive samples found in target",  # torchmetrics, for a batch without some class
    r"No negative samples found in target",
    r"Your `IterableDataset` has `__len__` defined",  # litdata's loaders give each worker its own part
    r"'set_vital' is deprecated",  # raised inside torchdata's StatefulDataLoader
    r"To copy construct from a tensor, it is recommended",  # raised inside inductor's int8 lowering (export --int8)
    r"# The axis name: \w+ will not be used",  # the ONNX exporter, for an axis that several inputs share (--packed)
)
LOG_LINES = re.compile(r"💡 Tip: |`weights_only` was not set|<enum '\w+'> is an Enum subclass|"
                       r"No CUDA runtime is found")  # the last two: importing torchao, and inductor on a CPU
LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero",  # rank_zero_info's
           "lightning_utilities.core.rank_zero", "lightning.pytorch.trainer.connectors.checkpoint_connector",
           "torch.utils._pytree", "torch.utils.cpp_extension")


def verbose(argv: list[str] | None = None) -> bool:
    """Whether the command line (``argv``) or the environment asks for every line."""
    return "--verbose" in (argv or []) or os.environ.get(VERBOSE_ENV, "") not in ("", "0")


class _DropLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not LOG_LINES.match(record.getMessage())


@contextmanager
def quiet(argv: list[str] | None = None) -> Iterator[None]:
    """Within: the lines above hidden (unless verbose), every other warning and log line as it was."""
    if verbose(argv):
        yield
        return
    drop = _DropLines()
    loggers = [logging.getLogger(name) for name in LOGGERS]
    with warnings.catch_warnings():
        for pattern in WARNINGS:
            warnings.filterwarnings("ignore", message=pattern)
        for logger in loggers:
            logger.addFilter(drop)
        try:
            yield
        finally:
            for logger in loggers:
                logger.removeFilter(drop)
