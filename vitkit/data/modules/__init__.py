"""Lightning data modules, each over the readers beside it in ``vitkit.data``: in-memory digits, image folders and CSV
/ JSON-lines manifests (``images.py``), litdata shards (``streaming.py``), Hugging Face datasets (``hf.py``), images
with masks (``segmentation.py``), images with boxes (``detection.py``), images with depth maps (``depth.py``), the
encoder-decoder's text and digit strings (``text.py``). Training batches cross to the device as uint8 and are
normalised there."""

from .depth import DepthDataModule, HFDepthDataModule
from .detection import DetectionDataModule, HFDetectionDataModule
from .images import DigitsDataModule, ImageFolderDataModule, ManifestDataModule, UnlabeledImageDataModule
from .segmentation import HFSegmentationDataModule, SegmentationDataModule, StreamingSegmentationDataModule
from .text import OcrDigitsDataModule, Seq2SeqDataModule

__all__ = ["DepthDataModule", "DetectionDataModule", "DigitsDataModule", "HFDepthDataModule", "HFDetectionDataModule",
           "HFDataModule",
           "HFSegmentationDataModule",
           "ImageFolderDataModule",
           "ManifestDataModule", "OcrDigitsDataModule",
           "SegmentationDataModule", "Seq2SeqDataModule", "StreamingImageDataModule",
           "StreamingSegmentationDataModule", "UnlabeledImageDataModule"]


def __getattr__(name: str):
    if name == "StreamingImageDataModule":  # imports litdata, which runs without it need not load
        from .streaming import StreamingImageDataModule

        return StreamingImageDataModule
    if name == "HFDataModule":  # imports the datasets library, likewise
        from .hf import HFDataModule

        return HFDataModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
