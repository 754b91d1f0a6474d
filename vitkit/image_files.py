"""Which files vitkit reads as images, torch-free (for the ONNX runner's commands as for the data modules): the
suffixes, the image files under a folder, and 16-bit images brought to the 8 bits the models take."""

from __future__ import annotations

from pathlib import Path

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def is_image_file(path: Path) -> bool:
    return path.suffix.lower() in IMAGE_SUFFIXES


def image_files(folder: Path) -> list[Path]:
    """The image files under ``folder``, at every depth, sorted."""
    return sorted(f for f in folder.rglob("*") if f.is_file() and is_image_file(f))


def eight_bit(image):
    """A PIL image with 8 bits a channel: a 16-bit grey image (PNG, TIFF; Pillow's modes ``I;16*`` and ``I``) scaled
    from its 0-65535 range, which Pillow's ``convert("RGB")`` would clip at 255 (almost every pixel white); any
    other image as it is."""
    if not (image.mode.startswith("I;16") or image.mode == "I"):
        return image
    import numpy as np
    from PIL import Image

    values = np.asarray(image).astype(np.float64)
    return Image.fromarray(np.clip(np.rint(values / 257.0), 0, 255).astype(np.uint8), mode="L")
