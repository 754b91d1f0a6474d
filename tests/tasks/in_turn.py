"""``python tests/tasks/in_turn.py RUNS.json``: the training command once for each argument list in RUNS.json, one
after another in this process, so that a test's multi-process runs start their processes (and join the process
group) once. Start it on every rank (``conftest.launch``). An argument ``glob:PATTERN`` is the one path that
matches PATTERN when its run starts (a checkpoint an earlier run wrote). After each run, rank 0 writes
``ran.json`` into the run's root: the strategy that ran and whether it left every parameter sharded."""

import glob
import json
import sys

from torch.distributed.tensor import DTensor

from vitkit.cli.train import cli_main


def _resolve(arg: str) -> str:
    if not arg.startswith("glob:"):
        return arg
    (match,) = glob.glob(arg[len("glob:"):])
    return match


if __name__ == "__main__":
    every, sys.argv = json.load(open(sys.argv[1])), sys.argv[:1]
    for args in every:
        trainer = cli_main([_resolve(a) for a in args]).trainer
        if trainer.is_global_zero:
            sharded = all(isinstance(p, DTensor) for p in trainer.lightning_module.parameters())
            with open(f"{trainer.default_root_dir}/ran.json", "w") as f:
                json.dump([type(trainer.strategy).__name__, sharded], f)
