"""Streaming shards with litdata: ImageNet-scale data across ranks and nodes, each sample once per epoch,
and the loader's position in the checkpoint, so a run killed mid-epoch resumes at the batch where it was.

The shards are written by ``vitkit prepare-data`` (``vitkit/shards.py``). litdata gives every rank and
worker its own part of each epoch (``drop_last=False``: no sample is dropped), so ranks can end an epoch with
different numbers of batches; ``EvenBatches`` pads the shorter ones with empty batches, which the module
trains on as "no sample here", and DDP's collectives stay in step.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch.utilities import rank_zero_info
from litdata import StreamingDataLoader, StreamingDataset

from vitkit.shards import Decoder, decode, read_dataset_info, sample_seed, seeded
from vitkit.transforms import TRAIN_AUGMENT, eval_transform, train_transform

from .data import _data_cfg, _SkippingImages, collate_skipping
from .hparams import gather_from_ranks

log = logging.getLogger(__name__)


class ImageShards(StreamingDataset):
    """One split of a converted dataset, decoded and transformed: yields ``(image, label)``, or ``None`` for a
    sample that cannot be decoded (counted by the data module, like an unreadable file).

    The augmentation of each sample draws from its own stream (``sample_seed``), so what a sample becomes in
    an epoch does not depend on the rank or worker that reads it, or on where a run was resumed."""

    def __init__(self, input_dir: str, transform=None, *, shuffle: bool = False, seed: int = 0,
                 decoder: Decoder = "pil", **kwargs: Any) -> None:
        super().__init__(input_dir, shuffle=shuffle, drop_last=False, seed=seed, **kwargs)
        self.image_transform, self.decoder, self.augment_seed = transform, decoder, seed

    def __getitem__(self, index):
        sample = super().__getitem__(index)
        i = int(getattr(index, "index", index))
        try:
            img = decode(sample["image"], self.decoder)
        except Exception as e:  # noqa: BLE001 - a sample damaged after conversion (disk, upload)
            log.debug("skipping undecodable sample %d (%s): %s", i, sample.get("path"), e)
            return None
        if self.image_transform is None:
            return img, sample["label"]
        with seeded(sample_seed(self.augment_seed, self.current_epoch, i)):
            return self.image_transform(img), sample["label"]


def batches_per_rank(dataset: StreamingDataset, num_workers: int, batch_size: int) -> list[int]:
    """How many batches each rank's loader yields in an epoch: litdata gives each worker a number of samples
    and every worker ends with its own partial batch. The counts depend on the dataset size, ranks, workers
    and batch size, not on the epoch's shuffle."""
    workers = max(num_workers, 1)
    dataset.get_len(workers, batch_size)  # builds litdata's shuffler for this rank layout
    _, intervals = dataset.shuffler.get_chunks_and_intervals_per_workers(
        dataset.distributed_env, workers, batch_size, dataset.current_epoch)
    per_worker = [math.ceil(sum(iv[2] - iv[1] for iv in worker) / batch_size) for worker in intervals]
    return [sum(per_worker[r * workers:(r + 1) * workers]) for r in range(dataset.distributed_env.world_size)]


class EvenBatches:
    """A training ``StreamingDataLoader`` with the same number of batches per epoch on every rank (the shorter
    ranks end with empty batches), and a position that can be saved and restored at any batch.

    ``position()`` / ``restore()`` are deliberately not ``state_dict()`` / ``load_state_dict()``: Lightning
    would save a loader with those from rank 0 alone, and restore rank 0's position on every rank."""

    def __init__(self, loader: StreamingDataLoader) -> None:
        self.loader = loader
        counts = batches_per_rank(loader.dataset, loader.num_workers, loader.batch_size)
        self.rank = loader.dataset.distributed_env.global_rank
        self.real, self.length = counts[self.rank], max(counts)
        self.batches = self.real_batches = 0  # yielded so far in this epoch
        self._resume: dict | None = None

    def __len__(self) -> int:
        return self.length

    def __iter__(self):
        resume, self._resume = self._resume, None
        if resume is not None and resume["batches"] >= self.length:  # saved at the end of an epoch
            self.loader.current_epoch, resume = resume["epoch"], None
        if resume is None:  # a new epoch; litdata's own iterator may have been left before its end
            self.loader.restore = False
            self.batches = self.real_batches = 0
            real = iter(self.loader)
        else:
            self.batches, self.real_batches = resume["batches"], resume["real_batches"]
            if self.real_batches >= self.real:  # only padding was left: litdata's epoch is over
                self.loader.current_epoch, real = resume["epoch"], iter(())
            else:
                self.loader.load_state_dict(resume["loader"])
                real = iter(self.loader)
        for batch in real:
            self.batches += 1
            self.real_batches += 1
            yield batch
        if self.real_batches != self.real:
            raise RuntimeError(f"rank {self.rank}: the streaming loader yielded {self.real_batches} batches this "
                               f"epoch where {self.real} were expected from litdata's assignment")
        while self.batches < self.length:
            self.batches += 1
            yield None, None, 0  # as a batch whose every file was unreadable: no sample on this rank

    def position(self) -> dict[str, Any]:
        """Where this rank is in the epoch: counted in batches handed to training (Lightning does not
        prefetch from a loader with a length), so a restore continues with the next one."""
        return {"loader": self.loader.state_dict(), "epoch": self.loader.current_epoch, "batches": self.batches,
                "real_batches": self.real_batches, "length": self.length}

    def restore(self, position: dict[str, Any]) -> None:
        """Continue from ``position`` at the next ``iter()``."""
        if position["length"] != self.length:
            raise ValueError(f"the checkpoint's loader position is for {position['length']} batches per epoch, this "
                             f"loader has {self.length}: resume with the batch size, number of workers and number "
                             "of ranks the checkpoint was written with")
        self._resume = position


class StreamingImageDataModule(_SkippingImages):
    """A dataset converted by ``vitkit prepare-data`` (a local folder, or an object-store URL such as
    ``s3://bucket/imagenet`` that litdata reads), streamed with litdata, with the transforms, preset-linked
    normalisation and skipping of ``ImageFolderDataModule``.

    Each epoch is shuffled anew (chunk order and samples within chunks, from ``seed`` and the epoch), and
    every sample is read exactly once per epoch across all ranks and workers. The training loader's position
    on every rank is saved in checkpoints: ``--ckpt_path last`` continues mid-epoch at the next batch."""

    def __init__(self, root: str, img_size: int = 224, batch_size: int = 128, num_workers: int = 8,
                 model_name: str | None = None, auto_augment: str | None = "rand-m9-mstd0.5-inc1",
                 re_prob: float = 0.25, scale: tuple[float, float] = (0.08, 1.0), hflip: float = 0.5,
                 color_jitter: float | None = 0.4,
                 crop_pct: float | None = None, mean: tuple[float, ...] | None = None,
                 std: tuple[float, ...] | None = None, interpolation: str | None = None,
                 pin_memory: bool = True, seed: int = 0, decoder: Literal["pil", "torchvision"] = "pil",
                 cache_dir: str | None = None, max_cache_size: str = "100GB") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.root = root if "://" in root else str(Path(root).expanduser().resolve())
        self.info = read_dataset_info(self.root)
        self.classes = self.info["classes"]
        self.num_classes = len(self.classes)
        self.data_cfg = _data_cfg(model_name, img_size, crop_pct=crop_pct, mean=mean, std=std,
                                  interpolation=interpolation)
        self._train_loader: EvenBatches | None = None
        self._resume: list[dict] | None = None

    def split_location(self, split: str) -> str:
        return self.root.rstrip("/") + "/" + split

    def describe(self) -> str:
        return self.root

    def _shards(self, split: str, transform, shuffle: bool) -> ImageShards:
        hp = self.hparams
        return ImageShards(self.split_location(split), transform, shuffle=shuffle, seed=hp.seed, decoder=hp.decoder,
                           cache_dir=hp.cache_dir, max_cache_size=hp.max_cache_size)

    def setup(self, stage: str | None = None) -> None:
        hp = self.hparams
        self.train_set = self._shards("train", train_transform(
            self.data_cfg, **{k: hp[k] for k in TRAIN_AUGMENT}),
            shuffle=True)
        self.val_set = self._shards("val", eval_transform(self.data_cfg), shuffle=False)
        if "test" in self.info["splits"]:
            self.test_set = self._shards("test", eval_transform(self.data_cfg), shuffle=False)
        self.reset_counts()

    def _loader(self, ds: ImageShards, train: bool) -> StreamingDataLoader:
        hp = self.hparams
        # a generator of its own: starting an epoch's iterator must not draw from the global stream, which
        # drop path and mixup use and checkpoints restore (the workers' seeds do not matter, see ImageShards)
        return StreamingDataLoader(ds, batch_size=hp.batch_size, num_workers=hp.num_workers,
                                   collate_fn=collate_skipping, generator=torch.Generator().manual_seed(hp.seed),
                                   pin_memory=hp.pin_memory and torch.cuda.is_available())

    def train_dataloader(self) -> EvenBatches:
        previous, self._train_loader = self._train_loader, EvenBatches(self._loader(self.train_set, True))
        if previous is not None:  # rebuilt between epochs (reload_dataloaders_every_n_epochs): keep the epoch count
            self._train_loader.loader.current_epoch = previous.loader.current_epoch
        if self._resume is not None:
            self._restore_train_loader()
        if self.trainer is not None and self.trainer.world_size > 1:
            rank_zero_info(f"streaming {self.split_location('train')}: {len(self._train_loader)} batches per rank "
                           "per epoch")
        return self._train_loader

    # -- the training loader's position, one per rank, in the checkpoint -----------------------------------

    def state_dict(self) -> dict[str, Any]:
        if self.trainer is None or self._train_loader is None:
            return {}
        return {"train_positions": gather_from_ranks(self.trainer, self._train_loader.position())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # called before the loaders are built (the module's optimizer setup asks for their length first)
        self._resume = state.get("train_positions")
        if self._train_loader is not None and self._resume is not None:
            self._restore_train_loader()

    def _restore_train_loader(self) -> None:
        positions, self._resume = self._resume, None
        world = self.trainer.world_size if self.trainer is not None else 1
        if len(positions) != world:
            raise ValueError(f"the checkpoint holds the streaming loader positions of {len(positions)} rank(s), "
                             f"this run has {world}: resume on as many ranks as the run that wrote it")
        self._train_loader.restore(positions[self.trainer.global_rank if self.trainer is not None else 0])
