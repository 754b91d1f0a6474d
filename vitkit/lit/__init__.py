"""Lightning glue: the only package code that imports lightning."""

from .callbacks import ModelCheckpoint
from .classifier import EMA, ImageClassifier
from .cli import VitkitCLI, cli_main
from .data import DigitsDataModule, ImageFolderDataModule

__all__ = ["EMA", "DigitsDataModule", "ImageClassifier", "ImageFolderDataModule", "ModelCheckpoint", "VitkitCLI",
           "cli_main"]
