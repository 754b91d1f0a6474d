"""Text data for the encoder-decoder: a small tokenizer, TSV files, synthetic tasks, and digit-string images.

Every batch is ``(src, tgt_in, tgt_out)``: source ids (B, S) or images (B, C, H, W), the target with
BOS in front (B, T), and the target with EOS at the end (B, T), both padded with ``pad_id``.
"""

from __future__ import annotations

import csv
import random
from collections import Counter
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import Dataset

from vitkit.errors import MissingFileError, UsageError

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIALS = (PAD, BOS, EOS, UNK)  # ids 0, 1, 2, 3: the presets' pad_id, bos_id, eos_id


class Tokenizer:
    """Characters or whitespace-separated words <-> ids.

    Specials first. Stored as a plain dict inside
    checkpoints (``to_dict`` / ``from_dict``), so a trained model can decode without its data."""

    def __init__(self, vocab: list[str], level: str = "char") -> None:
        if level not in ("char", "word"):
            raise UsageError(f"tokenizer level must be 'char' or 'word', got {level!r}")
        if tuple(vocab[:4]) != SPECIALS:
            raise UsageError(f"vocabulary must start with {SPECIALS}, got {vocab[:4]}")
        self.vocab, self.level = list(vocab), level
        self.index = {t: i for i, t in enumerate(self.vocab)}

    @classmethod
    def build(cls, texts, level: str = "char", min_count: int = 1) -> Tokenizer:
        counts = Counter(t for text in texts for t in (text.split() if level == "word" else text))
        return cls([*SPECIALS, *sorted(t for t, c in counts.items() if c >= min_count)], level)

    def __len__(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        unk = self.index[UNK]
        return [self.index.get(t, unk) for t in (text.split() if self.level == "word" else text)]

    def decode(self, ids) -> str:
        """Ids up to the first EOS; pads and BOS dropped, unknowns shown as <unk>."""
        out = []
        for i in (ids.tolist() if isinstance(ids, Tensor) else ids):
            if i == self.index[EOS]:
                break
            if i not in (self.index[PAD], self.index[BOS]):
                out.append(self.vocab[i])
        return (" " if self.level == "word" else "").join(out)

    def to_dict(self) -> dict:
        return {"vocab": self.vocab, "level": self.level}

    @classmethod
    def from_dict(cls, d: dict) -> Tokenizer:
        return cls(d["vocab"], d["level"])


def collate_text(pairs: list[tuple[list[int], list[int]]]) -> tuple[Tensor, Tensor, Tensor]:
    """[(src ids, tgt ids)] -> src (B, S), tgt_in = [BOS, y] (B, T), tgt_out = [y, EOS] (B, T); right-padded."""
    bos, eos = SPECIALS.index(BOS), SPECIALS.index(EOS)
    S = max(len(s) for s, _ in pairs)
    T = max(len(t) for _, t in pairs) + 1
    src = torch.zeros(len(pairs), S, dtype=torch.long)
    tgt_in = torch.zeros(len(pairs), T, dtype=torch.long)
    tgt_out = torch.zeros(len(pairs), T, dtype=torch.long)
    for i, (s, t) in enumerate(pairs):
        src[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        tgt_in[i, : len(t) + 1] = torch.tensor([bos, *t], dtype=torch.long)
        tgt_out[i, : len(t) + 1] = torch.tensor([*t, eos], dtype=torch.long)
    return src, tgt_in, tgt_out


def synthetic_pairs(task: str, n: int, min_len: int, max_len: int, symbols: str, seed: int) -> list[tuple[str, str]]:
    """Random strings over ``symbols`` and their copy, reversal or sorted form."""
    ops = {"copy": lambda s: s, "reverse": lambda s: s[::-1], "sort": lambda s: "".join(sorted(s))}
    if task not in ops:
        raise UsageError(f"task must be one of {sorted(ops)} or 'tsv', got {task!r}")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        s = "".join(rng.choice(symbols) for _ in range(rng.randint(min_len, max_len)))
        out.append((s, ops[task](s)))
    return out


def read_tsv(path: str | Path) -> list[tuple[str, str]]:
    """``source<TAB>target`` per line; a line without exactly one tab is an error that names it."""
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"TSV file {str(path)!r} does not exist")
    pairs = []
    with path.open(newline="", encoding="utf-8") as f:
        for n, row in enumerate(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE), 1):
            if not row:
                continue
            if len(row) != 2:
                raise UsageError(f"{path}:{n}: expected 'source<TAB>target', got {len(row)} field(s): {row!r:.80}")
            pairs.append((row[0], row[1]))
    if not pairs:
        raise UsageError(f"{path} holds no source/target pairs")
    return pairs


class PairSet(Dataset):
    """Text pairs, encoded once: items are (source ids, target ids)."""

    def __init__(self, pairs, src_tok: Tokenizer, tgt_tok: Tokenizer) -> None:
        self.items = [(src_tok.encode(s), tgt_tok.encode(t)) for s, t in pairs]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        return self.items[i]


class DigitStrings(Dataset):
    """Images of 1..max_digits handwritten digits side by side, and the string they spell.

    Each digit is one of scikit-learn's 8x8 scans (from the given pool of indices), upsampled to
    ``height``; digits are placed left to right with random gaps and vertical jitter on a canvas of
    (height, width). Item i is drawn from a generator seeded with (seed, i), so a set is fixed."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, n: int, max_digits: int, height: int, width: int,
                 seed: int) -> None:
        self.images = torch.from_numpy(images).float() / 16.0  # (P, 8, 8) in [0, 1]
        self.labels, self.n, self.max_digits = labels, n, max_digits
        self.height, self.width, self.seed = height, width, seed
        if max_digits * height > width:
            raise UsageError(f"{max_digits} digits of {height}px do not fit in width {width}")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[Tensor, str]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        k = int(torch.randint(1, self.max_digits + 1, (1,), generator=g))
        pick = torch.randint(len(self.images), (k,), generator=g)
        digits = F.interpolate(self.images[pick][:, None], size=(self.height, self.height), mode="bilinear",
                               align_corners=False)[:, 0]  # (k, h, h)
        canvas = torch.zeros(self.height, self.width)
        slack = self.width - k * self.height
        gaps = torch.rand(k + 1, generator=g)
        gaps = (gaps / gaps.sum() * slack).floor().long()
        x = int(gaps[0])
        for j in range(k):
            canvas[:, x: x + self.height] = torch.maximum(canvas[:, x: x + self.height], digits[j])
            x += self.height + int(gaps[j + 1])
        text = "".join(str(int(self.labels[p])) for p in pick)
        return (canvas[None] - 0.5) / 0.5, text  # (1, h, w) normalised to [-1, 1]
