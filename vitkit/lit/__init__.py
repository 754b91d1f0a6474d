"""The names recipes, checkpoints and the docs give to vitkit's Lightning classes (``vitkit.lit.ImageClassifier``,
``vitkit.lit.ImageFolderDataModule``, ...), in one place. Each is defined in its task (``vitkit.tasks``), in the
training base (``vitkit.training``) or beside the readers its data module wraps (``vitkit.data.modules``)."""

from vitkit.data.modules import (
    DepthDataModule,
    DetectionDataModule,
    DigitsDataModule,
    HFDepthDataModule,
    HFDetectionDataModule,
    HFSegmentationDataModule,
    ImageFolderDataModule,
    ManifestDataModule,
    OcrDigitsDataModule,
    SegmentationDataModule,
    Seq2SeqDataModule,
    StreamingSegmentationDataModule,
    UnlabeledImageDataModule,
)
from vitkit.data.text import Tokenizer
from vitkit.tasks.classification import (
    Frozen,
    Full,
    ImageClassifier,
    LoRA,
    MultiLabel,
    SingleLabel,
    Teacher,
)
from vitkit.tasks.depth import DepthEstimator, DepthLoss
from vitkit.tasks.detection import Detector, SetLoss
from vitkit.tasks.pretraining import DINOPretraining, MaskedImageModeling
from vitkit.tasks.segmentation import Segmenter
from vitkit.tasks.text import Seq2SeqModule
from vitkit.training import (
    EMA,
    AtomicCheckpointIO,
    CSVLogger,
    FSDP2Strategy,
    ModelCheckpoint,
    Recipe,
    StepsPerEpoch,
    TrainingCurves,
)

__all__ = ["EMA", "AtomicCheckpointIO", "CSVLogger", "DINOPretraining", "DepthDataModule", "DepthEstimator",
           "DepthLoss", "DetectionDataModule", "Detector", "HFDepthDataModule",
           "HFDetectionDataModule",
           "DigitsDataModule", "FSDP2Strategy", "SetLoss",
           "Frozen", "Full", "LoRA", "MultiLabel", "Recipe", "SingleLabel", "Teacher",
           "HFDataModule", "HFSegmentationDataModule", "ImageClassifier", "ImageFolderDataModule", "ManifestDataModule",
           "MaskedImageModeling",
           "ModelCheckpoint", "OcrDigitsDataModule", "SegmentationDataModule", "Segmenter", "Seq2SeqDataModule",
           "Seq2SeqModule", "StepsPerEpoch", "StreamingImageDataModule",
           "StreamingSegmentationDataModule", "Tokenizer", "TrainingCurves",
           "UnlabeledImageDataModule"]


def __getattr__(name: str):
    if name in ("StreamingImageDataModule", "HFDataModule"):  # they import litdata, datasets: loaded when named
        import vitkit.data.modules

        return getattr(vitkit.data.modules, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
