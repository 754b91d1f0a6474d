"""Callbacks for the training tests: per-rank sample records (DDP) and an interrupted run (resume)."""

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


class StopAfterEpoch(Callback):
    """Stops a run after ``epoch`` epochs without touching its schedule, like an interrupted job."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch + 1 >= self.epoch:
            trainer.should_stop = True
