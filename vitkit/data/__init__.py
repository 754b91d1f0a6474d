"""Data: timm's transforms for a model, ImageNet-layout folders and their decoding, the conversion to litdata
shards and the streaming dataset that reads them, and the encoder-decoder's text data. Plain PyTorch; the
Lightning DataModules in ``vitkit.lit`` are thin layers over these."""

from .folder import Decoder, SkippingImageFolder, collate_skipping, decode, scan_image_folder
from .shards import MARKER, prepare_data, read_dataset_info
from .text import DigitStrings, PairSet, Tokenizer, collate_text, read_tsv, synthetic_pairs
from .transforms import data_config, eval_transform, train_transform

__all__ = [
    "MARKER", "Decoder", "DigitStrings", "EvenBatches", "ImageShards", "PairSet", "SkippingImageFolder", "Tokenizer",
    "collate_skipping", "collate_text", "data_config", "decode", "eval_transform", "prepare_data",
    "read_dataset_info", "read_tsv", "scan_image_folder", "synthetic_pairs", "train_transform",
]


def __getattr__(name: str):
    if name in ("EvenBatches", "ImageShards"):  # they import litdata, which runs without streaming need not load
        from . import streaming

        return getattr(streaming, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
