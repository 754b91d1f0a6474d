"""`make demo`: train a small ViT on scikit-learn's bundled handwritten digits, on the CPU, and report."""

from __future__ import annotations

import sys
import time
from pathlib import Path

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "vit_tiny_digits.yaml"


def main(argv: list[str] | None = None) -> str:
    from vitkit.lit.cli import cli_main

    t0 = time.perf_counter()
    cli = cli_main(["fit", "--config", str(CONFIG), *(sys.argv[1:] if argv is None else argv)])
    seconds = time.perf_counter() - t0
    trainer = cli.trainer
    ckpt = trainer.checkpoint_callback
    top1 = float(ckpt.best_model_score) if ckpt.best_model_score is not None else float("nan")
    line = (f"digits demo: val top-1 {top1:.3f} in {seconds:.0f} s; checkpoint: {ckpt.best_model_path}; "
            f"logs: {trainer.logger.log_dir}")
    print(line)
    return line


if __name__ == "__main__":
    main()
