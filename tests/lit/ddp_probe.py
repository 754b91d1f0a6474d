"""A callback for the DDP test: each rank writes a hash of every training image it saw."""

import hashlib
import os

from lightning.pytorch.callbacks import Callback


class RecordSamples(Callback):
    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        x, _ = batch
        path = os.path.join(self.out_dir, f"rank{trainer.global_rank}.txt")
        with open(path, "a") as f:
            for img in x:  # the test turns augmentation off, so these are the dataset's own images
                f.write(hashlib.sha1(img.cpu().numpy().tobytes()).hexdigest() + "\n")
