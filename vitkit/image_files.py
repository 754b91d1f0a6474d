"""Which files vitkit reads as images, torch-free (for the ONNX runner's commands as for the data modules): the
suffixes, and the image files under a folder."""

from __future__ import annotations

from pathlib import Path

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def is_image_file(path: Path) -> bool:
    return path.suffix.lower() in IMAGE_SUFFIXES


def image_files(folder: Path) -> list[Path]:
    """The image files under ``folder``, at every depth, sorted."""
    return sorted(f for f in folder.rglob("*") if f.is_file() and is_image_file(f))
