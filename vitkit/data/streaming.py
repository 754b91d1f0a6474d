"""Reading converted shards with litdata: the streaming dataset of one split, each sample's own augmentation
stream, and a training loader with the same number of batches on every rank and a position that can be saved.

litdata gives every rank and worker its own part of each epoch (``drop_last=False``: no sample is dropped), so
ranks can end an epoch with different numbers of batches; ``EvenBatches`` pads the shorter ones with empty
batches, which the classifier trains on as "no sample here", and DDP's collectives stay in step.
"""

from __future__ import annotations

import io
import logging
import math
import os
import random
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from litdata import StreamingDataLoader, StreamingDataset
from PIL import Image

from vitkit.errors import UsageError

from .folder import Decoder, decode
from .segmentation import reduce_zero_label

log = logging.getLogger(__name__)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The random stream of one sample's augmentation: a function of the seed, the epoch and the sample only,
    so it does not depend on which rank or worker reads the sample, or on where a run was resumed."""
    return int(np.random.SeedSequence([seed, epoch, index]).generate_state(1, np.uint32)[0])


@contextmanager
def seeded(seed: int):
    """Python's, NumPy's and torch's global generators set to ``seed`` inside, and restored after, except in a
    loader worker, whose generators serve the samples alone (saving NumPy's state costs more than seeding it)."""
    from torch.utils.data import get_worker_info

    cpu = torch.default_generator  # not torch.manual_seed: it also queues a CUDA seed, with a stack trace each time
    states = None if get_worker_info() is not None else (random.getstate(), np.random.get_state(), cpu.get_state())
    random.seed(seed)
    np.random.seed(seed)
    cpu.manual_seed(seed)
    try:
        yield
    finally:
        if states is not None:
            random.setstate(states[0])
            np.random.set_state(states[1])
            cpu.set_state(states[2])


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
        label = sample["label"]
        if isinstance(label, (np.ndarray, torch.Tensor)):  # several labels: a multi-hot row
            label = torch.as_tensor(label).float()
        if self.image_transform is None:
            return img, label
        with seeded(sample_seed(self.augment_seed, self.current_epoch, i)):
            return self.image_transform(img), label


class MaskShards(StreamingDataset):
    """One split of a converted segmentation dataset through a joint transform (``vitkit/data/segmentation.py``):
    yields (uint8 image, int64 mask); each sample's augmentation draws from its own stream, as in
    :class:`ImageShards`. The conversion kept only pairs that decode, so a sample that does not is an error."""

    def __init__(self, input_dir: str, transform, *, shuffle: bool = False, seed: int = 0,
                 reduce_zero: bool = False, **kwargs: Any) -> None:
        super().__init__(input_dir, shuffle=shuffle, drop_last=False, seed=seed, **kwargs)
        self.joint_transform, self.augment_seed, self.reduce_zero = transform, seed, reduce_zero

    def __getitem__(self, index):
        sample = super().__getitem__(index)
        i = int(getattr(index, "index", index))
        image, mask = Image.open(io.BytesIO(sample["image"])), Image.open(io.BytesIO(sample["mask"]))
        if self.reduce_zero:
            mask = reduce_zero_label(mask)
        with seeded(sample_seed(self.augment_seed, self.current_epoch, i)):
            return self.joint_transform(image, mask, random)


def litdata_ranks() -> tuple[int, int]:
    """(world size, rank) as litdata assigns samples: the ``WORLD_SIZE`` / ``GLOBAL_RANK`` variables when set,
    else the process group, else one rank."""
    dist = torch.distributed
    size, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_available() and dist.is_initialized() else (1, 0)
    return int(os.environ.get("WORLD_SIZE", size)), int(os.environ.get("GLOBAL_RANK", rank))


def batches_per_rank(num_items: int, world_size: int, num_workers: int, batch_size: int) -> list[int]:
    """How many batches each rank's loader yields in an epoch with ``drop_last=False``, as litdata (0.2.76)
    budgets a split: every rank gets ``num_items // batch_size // world_size`` batches' worth of samples,
    spread over its workers (the first ones take one more batch each), and the last rank's next worker also takes
    the samples left over; every worker then ends with its own partial batch. The counts depend on the sizes
    alone, not on the epoch's shuffle; :class:`EvenBatches` checks them against what the loader yields."""
    workers = max(num_workers, 1)
    per_rank = num_items // batch_size // world_size
    base, rem = divmod(per_rank, workers)
    items = [[(base + (w < rem)) * batch_size for w in range(workers)] for _ in range(world_size)]
    items[-1][rem % workers] += num_items - per_rank * world_size * batch_size
    return [sum(math.ceil(n / batch_size) for n in rank) for rank in items]


class EvenBatches:
    """A training ``StreamingDataLoader`` with the same number of batches per epoch on every rank (the shorter
    ranks end with empty batches), and a position that can be saved and restored at any batch.

    ``position()`` / ``restore()`` are deliberately not ``state_dict()`` / ``load_state_dict()``: Lightning
    would save a loader with those from rank 0 alone, and restore rank 0's position on every rank."""

    def __init__(self, make_loader: Callable[[], StreamingDataLoader], num_items: int,
                 empty: Any = (None, None, 0)) -> None:
        self.make_loader, self.loader, self.empty = make_loader, make_loader(), empty
        world_size, self.rank = litdata_ranks()
        counts = batches_per_rank(num_items, world_size, self.loader.num_workers, self.loader.batch_size)
        rank = self.rank
        self.real, self.length = counts[rank], max(counts)
        self.batches = self.real_batches = 0  # yielded so far in this epoch
        self._resume: dict | None = None
        self._finished = True  # litdata's iterator ran to its end (or never ran)

    def __len__(self) -> int:
        return self.length

    def __iter__(self):
        resume, self._resume = self._resume, None
        if resume is not None and resume["batches"] >= self.length:  # saved at the end of an epoch
            self.loader.current_epoch, resume = resume["epoch"], None
        if resume is None:  # a new epoch
            if not self._finished:  # litdata's iterator was left before its end: a fresh loader starts anew
                epoch, self.loader = self.loader.current_epoch, self.make_loader()
                self.loader.current_epoch = epoch
            self.batches = self.real_batches = 0
            real = iter(self.loader)
        else:
            self.batches, self.real_batches = resume["batches"], resume["real_batches"]
            if self.real_batches >= self.real:  # only padding was left: litdata's epoch is over
                self.loader.current_epoch, real = resume["epoch"], iter(())
            else:
                self.loader.load_state_dict(resume["loader"])
                real = iter(self.loader)
        self._finished = False
        for batch in real:
            self.batches += 1
            self.real_batches += 1
            yield batch
        self._finished = True
        if self.real_batches != self.real:
            raise RuntimeError(f"rank {self.rank}: the streaming loader yielded {self.real_batches} batches this "
                               f"epoch where {self.real} were expected from litdata's assignment")
        while self.batches < self.length:
            self.batches += 1
            yield self.empty  # as a batch whose every file was unreadable: no sample on this rank

    def position(self) -> dict[str, Any]:
        """Where this rank is in the epoch: counted in batches handed to training (Lightning does not
        prefetch from a loader with a length), so a restore continues with the next one."""
        return {"loader": self.loader.state_dict(), "epoch": self.loader.current_epoch, "batches": self.batches,
                "real_batches": self.real_batches, "length": self.length}

    def restore(self, position: dict[str, Any]) -> None:
        """Continue from ``position`` at the next ``iter()``."""
        if position["length"] != self.length:
            raise UsageError(f"the checkpoint's loader position is for {position['length']} batches per epoch, this "
                             f"loader has {self.length}: resume with the batch size, number of workers and number "
                             "of ranks the checkpoint was written with")
        self._resume = position
