"""Lightning glue: the only package code that imports lightning."""

from .callbacks import ModelCheckpoint, TrainingCurves
from .classifier import EMA, ImageClassifier
from .cli import Seq2SeqCLI, VitkitCLI, cli_main
from .data import DigitsDataModule, ImageFolderDataModule
from .seq2seq import Seq2SeqModule
from .text_data import OcrDigitsDataModule, Seq2SeqDataModule, Tokenizer

__all__ = ["EMA", "DigitsDataModule", "ImageClassifier", "ImageFolderDataModule", "ModelCheckpoint",
           "OcrDigitsDataModule", "Seq2SeqCLI", "Seq2SeqDataModule", "Seq2SeqModule", "Tokenizer", "TrainingCurves",
           "VitkitCLI", "cli_main"]
