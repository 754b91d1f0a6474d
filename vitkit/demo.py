"""`make demo`: train a small ViT on scikit-learn's bundled handwritten digits, on the CPU, and report.

`make demo-ocr` (``python -m vitkit.demo ocr``): the image-to-text demo, a ViT encoder and a Transformer
decoder reading strings of 1-4 of those digits from composed images.
"""

from __future__ import annotations

import os
import sys
import time

from vitkit.recipes import recipes_dir

DEMOS = {  # name -> (config, how the line names the monitored metric)
    "digits": ("vit_tiny_digits.yaml", "val top-1"),
    "ocr": ("ocr_digits.yaml", "val exact-sequence accuracy"),
}


def main(argv: list[str] | None = None) -> str:
    from vitkit.cli.train import cli_main

    argv = list(sys.argv[1:] if argv is None else argv)
    demo = argv.pop(0) if argv and argv[0] in DEMOS else "digits"
    config, metric = DEMOS[demo]
    # each demo run gets a folder of its own (a later --trainer.default_root_dir in argv wins)
    root = os.path.join("runs", f"{demo}_demo", time.strftime("%Y%m%d-%H%M%S"))
    t0 = time.perf_counter()
    cli = cli_main(["fit", "--config", str(recipes_dir() / config), "--trainer.default_root_dir", root, *argv])
    seconds = time.perf_counter() - t0
    trainer = cli.trainer
    ckpt = trainer.checkpoint_callback
    best = float(ckpt.best_model_score) if ckpt.best_model_score is not None else float("nan")
    line = (f"{demo} demo: {metric} {best:.3f} in {seconds:.0f} s; checkpoint: {ckpt.best_model_path}; "
            f"run folder: {trainer.default_root_dir}")
    print(line)
    return line


if __name__ == "__main__":
    from vitkit.cli import guarded

    sys.exit(guarded(lambda: main() and 0))
