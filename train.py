"""Train, validate, test or predict with LightningCLI, e.g.

    python train.py fit --config configs/vit_tiny_digits.yaml
    python train.py fit --config configs/deit_small_in1k.yaml --data.root /data/imagenet
    python train.py fit --config configs/vit_tiny_digits.yaml --ckpt_path last      # resume
"""

from vitkit.lit.lightning_cli import cli_main

if __name__ == "__main__":
    cli_main()
