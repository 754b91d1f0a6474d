"""Throughput beside timm and torchvision: the same program as ``vitkit bench`` (vitkit/cli/bench.py).

    python benchmarks/throughput.py --models vit_base_patch16_224 --peers timm,torchvision \
        --mode infer --batch-sizes 16 --precision fp32 --out benchmarks/results/vit_b16_cpu.csv
"""

import sys

from vitkit.cli.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
