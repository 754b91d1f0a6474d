"""Data modules of the encoder-decoder: text pairs (synthetic tasks or TSV files) and digit-string images; the
datasets and the tokenizer are in ``vitkit/data/text.py``."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from vitkit.data.text import SPECIALS, DigitStrings, PairSet, Tokenizer, collate_text, read_tsv, synthetic_pairs
from vitkit.errors import UsageError

from .loaders import _TrainValLoaders


class Seq2SeqDataModule(_TrainValLoaders):
    """Text pairs: a built-in synthetic task (copy, reverse, sort) or TSV files.

    The tokenizers are built when the module is made (from the training pairs), so the vocabulary
    sizes can be linked into the model before anything runs, and they travel inside the checkpoint.

    Args:
        task: ``copy`` / ``reverse`` / ``sort`` (synthetic), or ``tsv`` to read ``train_path``/``val_path``.
        tokenizer: ``char`` or ``word`` (whitespace); one shared vocabulary when ``shared_vocab``.
        num_train, num_val, min_len, max_len, symbols: the synthetic task's size and alphabet.
    """

    collate_fn = staticmethod(collate_text)
    drop_last_train = False

    def __init__(self, task: str = "reverse", train_path: str | None = None, val_path: str | None = None,
                 tokenizer: str = "char", shared_vocab: bool = True, num_train: int = 20000, num_val: int = 500,
                 min_len: int = 4, max_len: int = 12, symbols: str = "abcdefghijklmnopqrstuvwxyz",
                 batch_size: int = 64, num_workers: int = 0, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        if task == "tsv":
            if not train_path or not val_path:
                raise UsageError("task='tsv' needs train_path and val_path")
            self.train_pairs, self.val_pairs = read_tsv(train_path), read_tsv(val_path)
        else:
            self.train_pairs = synthetic_pairs(task, num_train, min_len, max_len, symbols, seed)
            self.val_pairs = synthetic_pairs(task, num_val, min_len, max_len, symbols, seed + 1)
        if shared_vocab:
            self.src_tokenizer = self.tgt_tokenizer = Tokenizer.build(
                [t for pair in self.train_pairs for t in pair], tokenizer)
        else:
            self.src_tokenizer = Tokenizer.build([s for s, _ in self.train_pairs], tokenizer)
            self.tgt_tokenizer = Tokenizer.build([t for _, t in self.train_pairs], tokenizer)

    @property
    def src_vocab_size(self) -> int:
        return len(self.src_tokenizer)

    @property
    def tgt_vocab_size(self) -> int:
        return len(self.tgt_tokenizer)

    @property
    def tokenizers(self) -> dict:
        return {"src": self.src_tokenizer.to_dict(), "tgt": self.tgt_tokenizer.to_dict()}

    def setup(self, stage: str | None = None) -> None:
        self.train_set = PairSet(self.train_pairs, self.src_tokenizer, self.tgt_tokenizer)
        self.val_set = PairSet(self.val_pairs, self.src_tokenizer, self.tgt_tokenizer)



class OcrDigitsDataModule(_TrainValLoaders):
    """Image-to-text on composed digit strings.

    Train and validation use disjoint digit scans, so the
    validation images are held out twice over: new compositions of digits never seen in training."""

    drop_last_train = False

    def __init__(self, num_train: int = 20000, num_val: int = 1000, max_digits: int = 4, height: int = 16,
                 width: int = 64, batch_size: int = 64, num_workers: int = 0, val_fraction: float = 0.25,
                 seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.tgt_tokenizer = Tokenizer([*SPECIALS, *"0123456789"])

    src_vocab_size = 1  # the source is images
    tokenizers = property(lambda self: {"src": None, "tgt": self.tgt_tokenizer.to_dict()})
    tgt_vocab_size = property(lambda self: len(self.tgt_tokenizer))

    def setup(self, stage: str | None = None) -> None:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        hp = self.hparams
        d = load_digits()
        tr, va = train_test_split(np.arange(len(d.target)), test_size=hp.val_fraction, random_state=hp.seed,
                                  stratify=d.target)
        kw = dict(max_digits=hp.max_digits, height=hp.height, width=hp.width)
        self.train_set = DigitStrings(d.images[tr], d.target[tr], hp.num_train, seed=hp.seed, **kw)
        self.val_set = DigitStrings(d.images[va], d.target[va], hp.num_val, seed=hp.seed + 1, **kw)

    def collate_fn(self, items: list[tuple[Tensor, str]]) -> tuple[Tensor, Tensor, Tensor]:
        _, tgt_in, tgt_out = collate_text([([0], self.tgt_tokenizer.encode(t)) for _, t in items])
        return torch.stack([img for img, _ in items]), tgt_in, tgt_out
