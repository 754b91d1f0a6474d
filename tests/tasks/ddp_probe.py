"""Callbacks for the training tests: per-rank sample records (DDP), interrupted, killed, failing and
poisoned runs."""

import hashlib
import os
import signal

import torch
from lightning.pytorch.callbacks import Callback

from vitkit.models.packing import PackedBatch


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


class KillAt(Callback):
    """SIGKILLs its own process at a batch in mid-epoch, like the OOM killer or a lost node."""

    def __init__(self, epoch: int, batch: int) -> None:
        self.epoch, self.batch = epoch, batch

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.current_epoch == self.epoch and batch_idx == self.batch:
            os.kill(os.getpid(), signal.SIGKILL)


class RaiseOnRank(Callback):
    """One DDP rank fails at a given step while the others carry on into the next collective."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            raise RuntimeError(f"rank {self.rank} fails on purpose at step {self.step}")


class PoisonWeights(Callback):
    """Writes NaN into the classifier at a given step, so every later loss is NaN."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            with torch.no_grad():
                pl_module.model.head.weight.fill_(float("nan"))


class NanLogitsOnce(Callback):
    """The model's training loss is NaN for one training step only (a transient overflow in its logits or its
    reconstruction), on every rank or one; any vitkit module (``step_loss``)."""

    def __init__(self, step: int, rank: int | None = None) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step and self.rank in (None, trainer.global_rank):
            loss = pl_module.step_loss
            pl_module.step_loss = lambda batch: loss(batch) * float("nan")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        pl_module.__dict__.pop("step_loss", None)  # back to the class's step_loss


class RecordRng(Callback):
    """Per rank and step, a digest of the global torch generator's state: what drop path, mixup and
    augmentation will draw next."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        digest = hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest()
        with open(os.path.join(self.out_dir, f"rng{trainer.global_rank}.txt"), "a") as f:
            f.write(f"{trainer.global_step} {digest}\n")


class UnreadableBatchOnRank(Callback):
    """On one rank, one training batch comes out of the ImageFolder collate as if every file in it was
    unreadable (no images, all counted as skipped)."""

    def __init__(self, rank: int, batch: int) -> None:
        self.rank, self.batch = rank, batch

    def setup(self, trainer, pl_module, stage):
        dm = trainer.datamodule
        transfer = dm.on_after_batch_transfer

        seen = []

        def on_after_batch_transfer(batch, dataloader_idx):
            if trainer.training:
                seen.append(1)
                if trainer.global_rank == self.rank and len(seen) == self.batch + 1:
                    batch = (None, None, len(batch[1]))
            return transfer(batch, dataloader_idx)

        dm.on_after_batch_transfer = on_after_batch_transfer


class KillDuringSave(Callback):
    """SIGKILLs its own process halfway through writing the checkpoint at a given step: the bytes written
    so far reach the disk, the rest never does."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if trainer.global_step != self.step:
            return
        save = torch.save

        def torn_save(obj, f, *args, **kwargs):
            import io

            buf = io.BytesIO()
            save(obj, buf, *args, **kwargs)
            f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
            f.flush()
            os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)

        torch.save = torn_save


class RecordUpdates(Callback):
    """Per rank, one line per optimizer step: the global step, and whether the step changes the weights."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        with open(os.path.join(self.out_dir, f"updates{trainer.global_rank}.txt"), "a") as f:
            f.write(f"{trainer.global_step} {int(pl_module._stepped)}\n")


class RecordIds(Callback):
    """Per rank, one line per training sample: the epoch and the sample's id, read back from its colour (the
    streaming tests write solid images whose red and green levels encode the id, 4 levels apart); a packed batch's
    images too (and ``packed{rank}.txt`` says there were some)."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        x, _ = batch
        if isinstance(x, PackedBatch):  # each image's first pixel; and a note that the run packed
            x = torch.stack([image[:, :1, :1] for image in x.images()])
            open(os.path.join(self.out_dir, f"packed{trainer.global_rank}.txt"), "a").close()
        cfg = trainer.datamodule.data_cfg
        mean, std = torch.tensor(cfg.mean).view(1, 3), torch.tensor(cfg.std).view(1, 3)
        rgb = ((x[:, :, 0, 0].cpu() * std + mean) * 255).round().long()  # (B, 3)
        ids = (rgb[:, 0] // 4 + 64 * (rgb[:, 1] // 4)).tolist()
        with open(os.path.join(self.out_dir, f"ids{trainer.global_rank}.txt"), "a") as f:
            f.writelines(f"{trainer.current_epoch} {batch_idx} {i}\n" for i in ids)


class RecordTraining(Callback):
    """Each rank's training loss at every batch (``losses{rank}.txt``), and at the end the full weights of the
    module, EMA included, gathered from shards when sharded (``weights.pt``, rank 0)."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        with open(os.path.join(self.out_dir, f"losses{trainer.global_rank}.txt"), "a") as f:
            f.write(f"{trainer.global_step} {float(outputs['loss']):.9g}\n")

    def on_train_end(self, trainer, pl_module):
        self.save_weights(trainer, pl_module, "weights.pt")

    def save_weights(self, trainer, pl_module, name: str) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from torch.distributed.tensor import DTensor

        if any(isinstance(p, DTensor) for p in pl_module.parameters()):
            state = get_model_state_dict(pl_module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        else:
            state = {k: v.detach().cpu() for k, v in pl_module.state_dict().items()}
        if trainer.global_rank == 0:
            torch.save(state, os.path.join(self.out_dir, name))


class KillAfterShards(Callback):
    """Every rank writes its shard of the checkpoint at a given step with torch's distributed checkpoint, then
    SIGKILLs itself before the save completes, like a job lost in the middle of a sharded save."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if trainer.global_step != self.step:
            return
        import torch.distributed.checkpoint as dcp

        save = dcp.save

        def save_then_die(*args, **kwargs):
            save(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)

        dcp.save = save_then_die


class RecordStartWeights(Callback):
    """The full weights as training starts (after a resume has restored them), ``start_weights.pt`` on rank 0."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_start(self, trainer, pl_module):
        RecordTraining(self.out_dir).save_weights(trainer, pl_module, "start_weights.pt")
