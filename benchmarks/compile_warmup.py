"""Compile warm-up: the wall time of the first compiled training step (forward + backward), vitkit beside timm.

Run each library in a fresh process with an empty inductor cache, so that nothing is reused:

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python benchmarks/compile_warmup.py vitkit swin_tiny_patch4_window7_224
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python benchmarks/compile_warmup.py timm swin_tiny_patch4_window7_224

It also counts the warnings torch.compile raises on the way (graph breaks and tracing notes show up there).
"""

from __future__ import annotations

import argparse
import time
import warnings

import timm
import torch

import vitkit


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("library", choices=["vitkit", "timm"])
    p.add_argument("model")
    p.add_argument("--batch-size", type=int, default=2)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    model = (vitkit.create_model if args.library == "vitkit" else timm.create_model)(args.model).train()
    x = torch.randn(args.batch_size, 3, 224, 224)
    y = torch.randint(0, 1000, (args.batch_size,))
    compiled = torch.compile(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        torch.nn.functional.cross_entropy(compiled(x), y).backward()
        seconds = time.perf_counter() - t0
    print(f"{args.library} {args.model}: first compiled training step {seconds:.1f} s, "
          f"{len(caught)} warning(s) {sorted({str(w.message)[:80] for w in caught})}")


if __name__ == "__main__":
    main()
