"""What every data module's loaders share: the training order as a function of the seed, the epoch and the rank
(``EpochSampler``), a training loader that resumes mid-epoch (``ResumableLoader``; ``RankPositions`` for streaming
loaders, whose place is per rank), the refusal of a split smaller than one batch, and the base of the modules that
serve train / val / test splits (``_TrainValLoaders``)."""

from __future__ import annotations

import itertools
import os

import lightning as L
import torch
from lightning.fabric.utilities.data import suggested_max_num_workers
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from vitkit.errors import UsageError

MAX_WORKERS = 10  # per device, where num_workers is left to the machine (None)


class EpochSampler(DistributedSampler):
    """An epoch's training order as a function of the run's seed (``seed_everything``), the epoch and the rank, as
    Lightning's distributed sampler makes it, on one process too; it also seeds the loader's own generator (the
    workers' seeds) by the epoch. Nothing is drawn from the global generator, so a resumed run shuffles its first
    epoch as the uninterrupted run did, whether the loader's iterator is new or, with persistent workers, reused.
    The loader is built with the epoch the run starts in: a resumed run's iterator is made before Lightning sets
    the sampler's epoch."""

    def __init__(self, dataset: Dataset, generator: torch.Generator, epoch: int = 0) -> None:
        dist = torch.distributed.is_available() and torch.distributed.is_initialized()
        super().__init__(dataset, num_replicas=torch.distributed.get_world_size() if dist else 1,
                         rank=torch.distributed.get_rank() if dist else 0, shuffle=True,
                         seed=int(os.environ.get("PL_GLOBAL_SEED", 0)))
        self.generator = generator
        self.set_epoch(epoch)

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.generator.manual_seed((self.seed * 1_000_003 + epoch) * 1_009 + self.rank)

    skip = 0  # the indices the next pass leaves out from its start (ResumableLoader's place in the epoch)

    def __iter__(self):
        skip, self.skip = self.skip, 0
        return itertools.islice(super().__iter__(), skip, None)


class ResumableLoader(DataLoader):
    """A training loader whose place in its epoch Lightning keeps in the checkpoint (``state_dict``): a run resumed
    from a checkpoint written mid-epoch goes on with the next batch of that epoch's order (:class:`EpochSampler`),
    repeating no image and leaving none out. Every rank is at the same batch when a checkpoint is written, so the
    one place Lightning saves (rank 0's) is every rank's."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._yielded = self._resume_at = 0

    def __iter__(self):
        start, self._resume_at = self._resume_at, 0
        if start >= len(self):  # saved after its last batch (at the epoch's validation): the next epoch is whole
            start = 0
        self.sampler.skip = start * self.batch_size
        self._yielded = start
        for batch in super().__iter__():
            self._yielded += 1
            yield batch

    def state_dict(self) -> dict:
        return {"batches": self._yielded}

    def load_state_dict(self, state: dict) -> None:
        self._resume_at = int(state.get("batches", 0))


def check_one_batch(samples: int, batch_size: int, trainer: L.Trainer | None, where: str) -> None:
    """Refuse, before training, a training split in which no rank gets one whole batch: with the last incomplete
    batch dropped, nothing would train, and Lightning would end the run with no error and no checkpoint."""
    world = trainer.world_size if trainer is not None else 1
    per_rank = -(-samples // world)  # the distributed sampler pads every rank to the same count
    if per_rank >= batch_size:
        return
    ranks = f" on {world} ranks ({per_rank} per rank)" if world > 1 else ""
    raise UsageError(f"the training split of {where} has {samples} sample(s){ranks}, fewer than one batch of "
                     f"{batch_size}; the last incomplete batch of an epoch is dropped, so nothing would train. Lower "
                     f"--data.batch_size to {max(1, per_rank)} or less, or add images")


class _TrainValLoaders(L.LightningDataModule):
    """Loaders over ``self.train_set`` / ``self.val_set`` and, when the data has one, ``self.test_set``.

    ``test`` evaluates the test split if there is one and the validation split otherwise, and says which;
    ``predict`` runs over the validation split."""

    collate_fn = None  # how samples become a batch, when they are not plain (tensor, label) pairs

    def collate_for(self, train: bool):
        """How the training (``train``) or evaluation loader's samples become a batch."""
        return self.collate_fn
    drop_last_train = True  # image batches keep one size; text batches keep every example
    may_yield_empty = False  # whether a batch can arrive empty (every file in it unreadable)
    test_set: Dataset | None = None

    def workers(self) -> int:
        """``num_workers``, or where it is None what the machine has for each of its devices: Lightning's
        suggestion (cores / devices - 1), at most ``MAX_WORKERS``."""
        n = self.hparams.get("num_workers")
        if n is None:
            devices = self.trainer.num_devices if self.trainer is not None else 1
            n = min(MAX_WORKERS, suggested_max_num_workers(devices))
        return n

    def loader(self, ds: Dataset, train: bool) -> DataLoader:
        """A loader over ``ds`` (a split of this module, or the same split in another transform) as the module's
        own are built: its batch, workers and collation; shuffled by (seed, epoch, rank) with ``train``."""
        hp = self.hparams
        sampler = generator = None
        if train:  # shuffled by (seed, epoch, rank), never by the global generator: see EpochSampler
            generator = torch.Generator()
            # the epoch Lightning will set on the sampler (a checkpoint written at validation's end, inside its
            # epoch, resumes with that epoch processed though not completed)
            epoch = self.trainer.fit_loop.epoch_progress.current.processed if self.trainer is not None else 0
            sampler = EpochSampler(ds, generator, epoch)
        pin = hp.get("pin_memory", False) and torch.cuda.is_available()
        workers = self.workers()
        kind = ResumableLoader if train else DataLoader
        return kind(ds, batch_size=hp.batch_size, sampler=sampler, generator=generator,
                    drop_last=train and self.drop_last_train, collate_fn=self.collate_for(train),
                    num_workers=workers, pin_memory=pin, persistent_workers=workers > 0)

    sets_up_locally = False  # setup() reads local data only, and once: the CLI may call it before fit

    def check_train_size(self, trainer: L.Trainer | None = None) -> None:
        """Refuse a training split smaller than one batch; the CLI calls it before fit (before the model summary and
        the logger's first file) where ``sets_up_locally``, and the training loader always."""
        if self.drop_last_train:
            check_one_batch(len(self.train_set), self.hparams.batch_size, trainer or self.trainer, self.describe())

    def train_dataloader(self) -> DataLoader:
        self.check_train_size()
        return self.loader(self.train_set, True)

    def val_dataloader(self) -> DataLoader:
        return self.loader(self.val_set, False)

    def test_dataloader(self) -> DataLoader:
        if self.test_set is not None:
            rank_zero_info(f"test: evaluating the test split of {self.describe()}")
        else:
            rank_zero_info(f"test: {self.describe()} has no test split; evaluating its val split")
        return self.loader(self.val_set if self.test_set is None else self.test_set, False)

    def describe(self) -> str:
        return type(self).__name__

    predict_dataloader = val_dataloader


class RankPositions:
    """A streaming training loader's position on every rank, in the checkpoint: ``self._train_loader`` has
    ``position()`` / ``restore()``, and ``train_dataloader`` calls :meth:`_restore_train_loader` when
    ``self._resume`` is set. (Not the loader's own ``state_dict``: Lightning would save rank 0's alone.)"""

    _train_loader = None
    _resume: list | None = None

    def state_dict(self) -> dict:
        if self.trainer is None or self._train_loader is None:
            return {}
        from vitkit.distributed import gather_from_ranks

        return {"train_positions": gather_from_ranks(self.trainer, self._train_loader.position())}

    def load_state_dict(self, state: dict) -> None:
        # Lightning restores a data module's state before the fit loop builds its loaders; the loader built then
        # takes the positions (and when a loader already exists, it takes them now)
        self._resume = state.get("train_positions")
        if self._train_loader is not None and self._resume is not None:
            self._restore_train_loader()

    def positioned_train_loader(self):
        """A new training loader (``self.loader``), at the checkpoint's position where the run resumes."""
        self._train_loader = self.loader(self.train_set, True)
        if self._resume is not None:
            self._restore_train_loader()
        return self._train_loader

    def _restore_train_loader(self) -> None:
        positions, self._resume = self._resume, None
        world = self.trainer.world_size if self.trainer is not None else 1
        if len(positions) != world:
            raise UsageError(f"the checkpoint holds the streaming loader positions of {len(positions)} rank(s), "
                             f"this run has {world}: resume on as many ranks as the run that wrote it")
        self._train_loader.restore(positions[self.trainer.global_rank if self.trainer is not None else 0])
