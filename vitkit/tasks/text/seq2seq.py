"""Training the encoder-decoder with Lightning: the recipe of Vaswani et al. (2017).

Label-smoothed cross-entropy (0.1) that ignores pads, AdamW (0.9, 0.98, eps 1e-9) and the paper's
schedule: linear warmup, then decay with 1/sqrt(step). Validation and test report token accuracy, exact
match of greedily decoded sequences and BLEU on the decoded text; predict returns the decoded text.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torchmetrics.text import BLEUScore

import vitkit
from vitkit.data.text import Tokenizer
from vitkit.training.base import TrainingModule
from vitkit.training.flat import Flat
from vitkit.training.recipe import Recipe
from vitkit.training.sharding import gathered

RECIPE = Recipe(lr=7e-4, weight_decay=0.0, betas=(0.9, 0.98), eps=1e-9, schedule="rsqrt", warmup_steps=4000)


class Seq2SeqModule(TrainingModule):
    """A vitkit encoder-decoder preset (text-to-text or image-to-text) trained with teacher forcing.

    Args:
        model_name: ``transformer_tiny`` / ``_base`` / ``_big``, or ``ocr_vit_tiny`` / ``ocr_swin_tiny``.
        src_vocab_size: linked from the data module by the CLI.
        tgt_vocab_size: linked from the data module by the CLI.
        tokenizers: linked from the data module by the CLI, and kept in the checkpoint's hyper-parameters so it
            can decode on its own.
        model_overrides: any other config field, e.g. ``{"pos_encoding": "rope", "norm": "pre"}``.
        label_smoothing: on the target tokens; pads are ignored.
        val_beam_size: the beam used for exact match and BLEU at validation.
        val_max_len: the longest decoded sequence at validation.
        recipe: the optimizer, schedule and steps (``vitkit.training.recipe.Recipe``, as for ``ImageClassifier``).
            Default the paper's: AdamW (0.9, 0.98, eps 1e-9) without weight decay, peaking at 7e-4 (the base model's
            512^-0.5 x 4000^-0.5) after ``warmup_steps: 4000`` of linear warmup, then lr x sqrt(warmup / step)
            (``schedule: rsqrt``).
    """

    FLAT = Flat(RECIPE)  # the flat lr, warmup_steps, betas, ... of before the recipe part

    def __init__(
        self,
        model_name: str = "transformer_tiny",
        src_vocab_size: int = 1000,
        tgt_vocab_size: int = 1000,
        tokenizers: dict | None = None,
        model_overrides: dict[str, Any] | None = None,
        label_smoothing: float = 0.1,
        val_beam_size: int = 1,
        val_max_len: int = 64,
        recipe: Recipe = RECIPE,
    ) -> None:
        super().__init__()
        self.keep_arguments()
        self.use_recipe(recipe)
        self.model = vitkit.create_model(model_name, src_vocab_size=src_vocab_size, tgt_vocab_size=tgt_vocab_size,
                                         **(model_overrides or {}))
        self.tgt_tokenizer = Tokenizer.from_dict(tokenizers["tgt"]) if tokenizers else None
        self.bleu = torch.nn.ModuleDict({split: BLEUScore(n_gram=4, smooth=True) for split in ("val", "test")})

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        return self.model(src, tgt_in)

    def _loss(self, logits: Tensor, tgt_out: Tensor) -> Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), tgt_out.flatten(), ignore_index=self.model.cfg.pad_id,
                               label_smoothing=self.hparams.label_smoothing)

    def step_loss(self, batch: tuple[Tensor, Tensor, Tensor]) -> Tensor:
        src, tgt_in, tgt_out = batch
        return self._loss(self(src, tgt_in), tgt_out)

    def _texts(self, ids: Tensor) -> list[str]:
        if self.tgt_tokenizer is None:
            return [" ".join(map(str, row.tolist())) for row in ids]
        words = self.tgt_tokenizer.level == "word"
        # BLEU counts words: characters are spaced out so char-level tasks are scored per character
        return [t if words else " ".join(t) for t in map(self.tgt_tokenizer.decode, ids)]

    def validation_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def predict_step(self, batch: Tensor | tuple[Tensor, ...], batch_idx: int) -> list[str]:
        """The decoded text of each source (a batch of sources, or (src, tgt_in, tgt_out) from the data)."""
        src = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self.translate(src, beam_size=self.hparams.val_beam_size)

    def _evaluate(self, batch: tuple[Tensor, Tensor, Tensor], split: str) -> None:
        src, tgt_in, tgt_out = batch
        B, pad, eos = src.shape[0], self.model.cfg.pad_id, self.model.cfg.eos_id
        logits = self(src, tgt_in)
        real = tgt_out != pad
        self.log(f"{split}/loss", self._loss(logits, tgt_out), prog_bar=True, batch_size=B)
        self.log(f"{split}/token_acc", ((logits.argmax(-1) == tgt_out) & real).sum() / real.sum(), batch_size=B)
        with gathered(self.model):  # ranks decode for different numbers of steps
            out = self.model.generate(src, max_len=min(self.hparams.val_max_len, tgt_out.shape[1] + 8),
                                      beam_size=self.hparams.val_beam_size)
        T = max(out.shape[1], tgt_out.shape[1])
        out, ref = F.pad(out, (0, T - out.shape[1]), value=pad), F.pad(tgt_out, (0, T - tgt_out.shape[1]), value=pad)
        ends = (out == eos).cumsum(1) - (out == eos).int()  # > 0 after the first EOS
        out = out.masked_fill(ends > 0, pad)
        self.log(f"{split}/exact_match", (out == ref).all(1).float().mean(), prog_bar=True, batch_size=B)
        hyps, refs = self._texts(out), self._texts(ref)
        self.bleu[split].update(hyps, [[r] for r in refs])
        self.log(f"{split}/bleu", self.bleu[split], batch_size=B)

    @torch.no_grad()
    def translate(self, src: Tensor, beam_size: int = 1, max_len: int | None = None) -> list[str]:
        """Decode a batch of sources to text with the checkpoint's own tokenizer."""
        with gathered(self.model):  # sharded: ranks decode for different numbers of steps
            out = self.model.generate(src.to(self.device), max_len or self.hparams.val_max_len, beam_size=beam_size)
        return [self.tgt_tokenizer.decode(t) for t in out]
