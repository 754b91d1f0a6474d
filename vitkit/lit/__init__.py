"""Lightning glue: the modules, data modules, callbacks and strategies that training runs on. Besides this package,
only the commands that run Lightning import it (``vitkit train``'s LightningCLI is ``vitkit/cli/train.py``)."""

from vitkit.data.text import Tokenizer

from .callbacks import AtomicCheckpointIO, CSVLogger, ModelCheckpoint, TrainingCurves
from .classifier import EMA, ImageClassifier
from .data import DigitsDataModule, ImageFolderDataModule, ManifestDataModule, UnlabeledImageDataModule
from .dino import DINOPretraining
from .mim import MaskedImageModeling
from .seq2seq import Seq2SeqModule
from .small_data import StepsPerEpoch
from .strategies import FSDP2Strategy
from .text_data import OcrDigitsDataModule, Seq2SeqDataModule

__all__ = ["EMA", "AtomicCheckpointIO", "CSVLogger", "DINOPretraining", "DigitsDataModule", "FSDP2Strategy",
           "HFDataModule", "ImageClassifier", "ImageFolderDataModule", "ManifestDataModule", "MaskedImageModeling",
           "ModelCheckpoint", "OcrDigitsDataModule", "Seq2SeqDataModule", "Seq2SeqModule", "StepsPerEpoch",
           "StreamingImageDataModule", "Tokenizer", "TrainingCurves", "UnlabeledImageDataModule"]


def __getattr__(name: str):
    if name == "StreamingImageDataModule":  # imports litdata, which runs without it need not load
        from .streaming import StreamingImageDataModule

        return StreamingImageDataModule
    if name == "HFDataModule":  # imports the datasets library, likewise
        from .hf import HFDataModule

        return HFDataModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
