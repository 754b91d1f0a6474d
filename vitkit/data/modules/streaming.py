"""Streaming shards with litdata: ImageNet-scale data across ranks and nodes, each sample once per epoch,
and every rank's loader position in the checkpoint, so a run killed mid-epoch resumes at the batch where it was.

The shards are written by ``vitkit prepare-data`` (``vitkit/data/shards.py``); the dataset and the even-length
loader are in ``vitkit/data/streaming.py``.
"""

from __future__ import annotations

import logging
import os
from functools import partial
from pathlib import Path

import torch
from lightning.pytorch.utilities import rank_zero_info
from litdata import StreamingDataLoader

from vitkit.data.folder import Decoder
from vitkit.data.shards import read_dataset_info
from vitkit.data.streaming import EvenBatches, ImageShards
from vitkit.errors import UsageError

from .images import SkippingImages
from .loaders import RankPositions

log = logging.getLogger(__name__)


class StreamingImageDataModule(RankPositions, SkippingImages):
    """Shards written by ``vitkit prepare-data``, streamed with litdata.

    A local folder, or an object-store URL such as ``s3://bucket/imagenet`` that litdata reads, with the transforms,
    preset-linked normalisation and skipping of ``ImageFolderDataModule``.

    Each epoch is shuffled anew (chunk order and samples within chunks, from ``seed`` and the epoch), and
    every sample is read exactly once per epoch across all ranks and workers. The training loader's position
    on every rank is saved in checkpoints: ``--ckpt_path last`` continues mid-epoch at the next batch."""

    def __init__(self, root: str, seed: int = 0, decoder: Decoder = "pil", cache_dir: str | None = None,
                 max_cache_size: str = "100GB", **image_args) -> None:
        super().__init__(**image_args)
        self.root = root if "://" in root else str(Path(os.path.expanduser(root)).resolve())
        self.info = read_dataset_info(self.root)
        if self.info.get("masks"):
            raise UsageError(f"{root} holds images with masks: stream it with "
                             "--data vitkit.lit.StreamingSegmentationDataModule and --model vitkit.lit.Segmenter")
        self.classes = self.info["classes"]
        self.num_classes = len(self.classes)
        self.multi_label = bool(self.info.get("multi_label", False))  # multi-hot targets (from manifests)

    def label_counts(self) -> tuple[torch.Tensor, int]:
        """How many training samples carry each class, as the conversion counted them (for ``pos_weight``)."""
        if "label_counts" not in self.info:
            raise UsageError(f"{self.root} records no label counts (a single-label conversion); leave pos_weight off")
        return torch.tensor(self.info["label_counts"], dtype=torch.float32), self.info["splits"]["train"]["samples"]

    def split_location(self, split: str) -> str:
        return self.root.rstrip("/") + "/" + split

    def describe(self) -> str:
        return self.root

    def _shards(self, split: str, transform, shuffle: bool) -> ImageShards:
        hp = self.hparams
        return ImageShards(self.split_location(split), transform, shuffle=shuffle, seed=hp.seed, decoder=hp.decoder,
                           cache_dir=hp.cache_dir, max_cache_size=hp.max_cache_size)

    def setup(self, stage: str | None = None) -> None:
        self.train_set = self._shards("train", self.train_transform(), shuffle=True)
        self.val_set = self._shards("val", self.eval_transform(), shuffle=False)
        if "test" in self.info["splits"]:
            self.test_set = self._shards("test", self.eval_transform(), shuffle=False)
        self.reset_counts()

    def loader(self, ds: ImageShards, train: bool) -> StreamingDataLoader:
        hp = self.hparams
        # a generator of its own: starting an epoch's iterator must not draw from the global stream, which
        # drop path and mixup use and checkpoints restore (the workers' seeds do not matter, see ImageShards)
        return StreamingDataLoader(ds, batch_size=hp.batch_size, num_workers=self.workers(),
                                   collate_fn=self.collate_for(train), generator=torch.Generator().manual_seed(hp.seed),
                                   pin_memory=hp.pin_memory and torch.cuda.is_available())

    def train_dataloader(self) -> EvenBatches:
        previous, self._train_loader = self._train_loader, EvenBatches(
            partial(self.loader, self.train_set, True), self.info["splits"]["train"]["samples"])
        if previous is not None:  # rebuilt between epochs (reload_dataloaders_every_n_epochs): keep the epoch count
            self._train_loader.loader.current_epoch = previous.loader.current_epoch
        if self._resume is not None:
            self._restore_train_loader()
        if self.trainer is not None and self.trainer.world_size > 1:
            rank_zero_info(f"streaming {self.split_location('train')}: {len(self._train_loader)} batches per rank "
                           "per epoch")
        return self._train_loader
