"""Hugging Face datasets for training: a hub name or local parquet / arrow / imagefolder / webdataset files, map-style
(each rank its part through the epoch sampler folders use) or streamed (split by node and loader worker, the same
number of steps on every rank, the stream's position in the checkpoint).

The readers and columns are in ``vitkit/data/hf.py``; the transforms, augmentation and skipping are the folder
module's (``SkippingImages``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info

from vitkit.data.folder import Decoder
from vitkit.data.hf import (
    HFImages,
    HFStream,
    carve,
    class_names,
    find_columns,
    label_index,
    multi_label,
    open_splits,
)
from vitkit.errors import UsageError

from .images import SkippingImages
from .loaders import RankPositions

log = logging.getLogger(__name__)


class HFDataModule(RankPositions, SkippingImages):
    """A Hugging Face dataset (the hub's cache, a save_to_disk folder, or data files).

    ``name`` is a hub name (``beans``, ``timm/mini-imagenet``; with
    ``revision`` and ``config_name``) or a local folder (``save_to_disk``'s, or one of data files);
    ``data_files`` are local parquet, arrow, imagefolder or webdataset files. The cache (``HF_DATASETS_CACHE``)
    answers first, without a network call.

    Columns: the one ``Image`` and the one ``ClassLabel`` (or list of ClassLabels) column unless named; a label
    column of strings maps to the sorted class names (``classes`` gives them for a stream). A list column gives
    several labels per image (``multi_label``: multi-hot targets, for ``--model.labels MultiLabel``): a
    ``Sequence(ClassLabel)``, lists of class names or indices, or a fixed-length multi-hot list. Splits:
    ``train_split`` / ``val_split`` / ``test_split``; without a validation split, ``val_fraction`` of train is
    held out by ``seed``, the same on every rank and run. ``streaming``: an iterable dataset with a
    ``shuffle_buffer``, split by node and worker."""

    def __init__(self, name: str | None = None, data_files: Any = None, config_name: str | None = None,
                 revision: str | None = None, image_column: str | None = None, label_column: str | None = None,
                 classes: list[str] | None = None, train_split: str = "train", val_split: str = "validation",
                 test_split: str | None = "test", val_fraction: float = 0.05, seed: int = 0, streaming: bool = False,
                 shuffle_buffer: int = 10_000, decoder: Decoder = "pil", **image_args) -> None:
        super().__init__(**image_args)
        if shuffle_buffer < 1:
            raise UsageError(f"shuffle_buffer must be >= 1 (rows held for shuffling a stream), got {shuffle_buffer}")
        self.where = name if name is not None else str(data_files)
        self.splits, self.hparams.val_split = open_splits(
            name, data_files, config_name=config_name, revision=revision, streaming=streaming,
            train_split=train_split, val_split=val_split, test_split=test_split, val_fraction=val_fraction)
        train = self.splits[train_split]
        self.image_column, self.label_column = find_columns(train.features, image_column, label_column, self.where)
        self.classes = class_names(train, self.label_column, classes, self.where)
        self.num_classes = len(self.classes)
        self.multi_label = multi_label(train.features[self.label_column])  # multi-hot targets
        if not streaming and len(train) == 0:
            raise UsageError(f"{self.where}: the split {train_split!r} has no rows")

    def describe(self) -> str:
        return self.where

    def label_counts(self) -> tuple[torch.Tensor, int]:
        """How many training rows carry each class (C,), and how many there are (for BCE's ``pos_weight``)."""
        if self.hparams.streaming:
            raise UsageError(f"{self.where}: pos_weight counts the labels of every training row, which a stream "
                             "cannot be read through for; leave pos_weight off")
        if not hasattr(self, "train_set"):
            self.setup("fit")
        column = self.train_set.ds[self.label_column]
        to_target = self.train_set.to_index
        counts = torch.zeros(self.num_classes)
        for value in column:
            target = to_target(value)
            counts += target if self.multi_label else torch.nn.functional.one_hot(
                torch.tensor(target), self.num_classes).float()
        return counts, len(column)

    def split_location(self, split: str) -> str:
        return f"{self.where} ({split})"

    def _wrap(self, ds, transform):
        hp = self.hparams
        to_index = label_index(ds.features[self.label_column], self.classes)
        kind = HFStream if hp.streaming else HFImages
        return kind(ds, self.image_column, self.label_column, to_index, transform, hp.decoder)

    def setup(self, stage: str | None = None) -> None:
        hp = self.hparams
        train, val = self.splits[hp.train_split], self.splits.get(hp.val_split)
        if val is None:
            if hp.streaming:
                raise UsageError(f"{self.where} has no split {hp.val_split!r}, and a stream cannot be carved; name "
                                 f"one with --data.val_split (its splits are {', '.join(self.splits)})")
            keep, held = carve(len(train), hp.val_fraction, hp.seed)
            train, val = train.select(keep), train.select(held)
            rank_zero_info(f"{self.where}: no {hp.val_split!r} split; {len(held)} of the {len(keep) + len(held)} "
                           f"rows of {hp.train_split!r} held out for validation (seed {hp.seed})")
        if hp.streaming:
            train, val = self._streams(train, shuffle=True), self._streams(val, shuffle=False)
        self.train_set = self._wrap(train, self.train_transform())
        self.val_set = self._wrap(val, self.eval_transform())
        test = self.splits.get(hp.test_split) if hp.test_split else None
        if test is not None:
            self.test_set = self._wrap(self._streams(test, False) if hp.streaming else test,
                                       self.eval_transform())
        self.reset_counts()

    def _streams(self, ds, shuffle: bool):
        """This rank's part of a stream (shards when they divide evenly among the ranks, else every n-th row),
        shuffled by the seed and the epoch (``set_epoch``) through a buffer when training."""
        from datasets.distributed import split_dataset_by_node

        world, rank = (self.trainer.world_size, self.trainer.global_rank) if self.trainer is not None else (1, 0)
        if shuffle:
            ds = ds.shuffle(seed=self.hparams.seed, buffer_size=self.hparams.shuffle_buffer)
        return split_dataset_by_node(ds, rank=rank, world_size=world) if world > 1 else ds

    # -- loaders ------------------------------------------------------------------------------------------------

    def loader(self, ds, train: bool):
        if not self.hparams.streaming:
            return super().loader(ds, train)
        from torchdata.stateful_dataloader import StatefulDataLoader

        hp = self.hparams
        loader = StatefulDataLoader(ds, batch_size=hp.batch_size, num_workers=self.workers(),
                                    collate_fn=self.collate_for(train),
                                    pin_memory=hp.pin_memory and torch.cuda.is_available())
        return EvenSteps(loader, self, train)

    def train_dataloader(self):
        if not self.hparams.streaming:
            return super().train_dataloader()
        return self.positioned_train_loader()

    def val_dataloader(self):
        return self.loader(self.val_set, False)

    def test_dataloader(self):
        if not self.hparams.streaming:
            return super().test_dataloader()
        return self.loader(self.test_set if self.test_set is not None else self.val_set, False)

    predict_dataloader = val_dataloader


class EvenSteps:
    """A streaming loader with the same number of batches on every rank: at each step the ranks agree (one small
    all-reduce) whether any still has data; a rank whose part ended first yields empty batches, which the module
    trains on as "no sample here", until all have ended. No sample is dropped and no rank waits on a collective
    the others never reach."""

    def __init__(self, loader, module, train: bool, empty: Any = (None, None, 0)) -> None:
        self.loader, self.module, self.train, self.empty = loader, module, train, empty
        self.fetched, self._before, self._resume = 0, {}, None

    def _progress(self) -> tuple[int, int]:
        """(epoch, batches trained on in it): Lightning fetches one batch ahead of training from a loader
        without a length, so what the loader has handed out is not what the run has used."""
        trainer = self.module.trainer
        if trainer is None:
            return 0, self.fetched
        return trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_progress.current.processed

    def __iter__(self):
        resume, self._resume = self._resume, None
        epoch = self._progress()[0]
        if resume is not None and resume["epoch"] == epoch:  # continue the epoch the checkpoint was written in
            self.loader.load_state_dict(resume["loader"])
            self.fetched = resume["batches"]
        else:
            self.fetched = 0
        if self.train:
            self.loader.dataset.set_epoch(epoch)  # a new shuffle each epoch, from the seed and the epoch
        self._before = {}
        it = iter(self.loader)
        dist = torch.distributed.is_available() and torch.distributed.is_initialized()
        device = torch.device("cuda", torch.cuda.current_device()) if dist and \
            torch.distributed.get_backend() == "nccl" else torch.device("cpu")
        while True:
            if self.train:  # where the stream stood before this batch, for a checkpoint written after the last
                self._before = {k: v for k, v in self._before.items() if k >= self.fetched - 2}
                self._before[self.fetched] = self.loader.state_dict()
            batch = next(it, None)
            alive = torch.tensor([batch is not None], dtype=torch.int32, device=device)
            if dist:
                torch.distributed.all_reduce(alive)
            if not alive.item():
                return
            self.fetched += 1
            yield batch if batch is not None else self.empty

    def position(self) -> dict[str, Any]:
        """The stream's state on this rank (``datasets``' ``state_dict``, per loader worker) after the batches
        trained on so far, and the epoch."""
        epoch, used = self._progress()
        state = self._before.get(used, self.loader.state_dict())
        return {"loader": state, "epoch": epoch, "batches": used}

    def restore(self, position: dict[str, Any]) -> None:
        """Continue from ``position`` at the next ``iter()`` if that is in the same epoch."""
        self._resume = position
