"""Train, validate, test or predict with LightningCLI, e.g.

    python train.py fit -c vit_tiny_digits
    python train.py fit -c deit_small_in1k --data.root /data/imagenet
    python train.py fit -c vit_tiny_digits --ckpt_path last      # resume
"""

import sys

from vitkit.cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python train.py"))
