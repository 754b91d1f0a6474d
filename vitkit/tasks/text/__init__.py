"""The encoder-decoder Transformer's training, on text pairs or on images (Vaswani et al.'s recipe)."""

from typing import TYPE_CHECKING

from vitkit.tasks.protocol import lazy_names

if TYPE_CHECKING:  # the names as type checkers and the API reference read them
    from .seq2seq import Seq2SeqModule as Seq2SeqModule

__all__, __getattr__ = lazy_names(__name__, {"Seq2SeqModule": ".seq2seq"})
