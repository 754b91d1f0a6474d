"""The encoder-decoder Transformer's training, on text pairs or on images (Vaswani et al.'s recipe)."""

from .seq2seq import Seq2SeqModule

__all__ = ["Seq2SeqModule"]
