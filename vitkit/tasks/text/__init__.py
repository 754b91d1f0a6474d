"""The encoder-decoder Transformer's training, on text pairs or on images (Vaswani et al.'s recipe)."""

from vitkit.tasks.protocol import lazy_names

__all__, __getattr__ = lazy_names(__name__, {"Seq2SeqModule": ".seq2seq"})
