"""Detectors of other libraries in vitkit's names (``vitkit.models.detection``): transformers'
``YolosForObjectDetection`` folders (``config.json`` and the weights, as ``save_pretrained`` writes them)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor

from vitkit.errors import MissingFileError

from .files import CheckpointError, read_file
from .formats import to_vitkit, unwrap
from .hf_config import preset_for


@dataclass
class DetectorFile:
    """What a detector's file holds: the backbone's preset and overrides, the detector's kind and settings, the
    weights in vitkit's names and the class names."""

    preset: str
    overrides: dict[str, Any]
    kind: str
    settings: dict[str, Any]
    state_dict: dict[str, Tensor]
    class_names: list[str] = field(default_factory=list)


def _weights(folder: Path) -> dict[str, Tensor]:
    weights = next((folder / n for n in ("model.safetensors", "pytorch_model.bin") if (folder / n).exists()), None)
    if weights is None:
        raise CheckpointError(f"{folder} has config.json but no model.safetensors or pytorch_model.bin")
    return unwrap(read_file(weights))


def transformers_yolos(folder: str | os.PathLike) -> DetectorFile:
    """A folder that transformers' ``YolosForObjectDetection.save_pretrained`` wrote: the ViT under ``vit.`` (its
    position table split into the class token's and the patches', kept by the backbone, and the detection tokens',
    kept by YOLOS), the mid-layer positions, and the class and box MLPs."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    if config.get("model_type") != "yolos":
        raise CheckpointError(f"{folder}/config.json has model_type={config.get('model_type')!r}, not 'yolos'")
    raw = _weights(folder)
    n = config.get("num_detection_tokens", 100)
    pos = raw.get("vit.embeddings.position_embeddings")
    if pos is None:
        raise CheckpointError(f"{folder}: no vit.embeddings.position_embeddings; not a YOLOS checkpoint")
    mids = [k for k in raw if k.endswith("mid_position_embeddings")]  # under encoder.interpolation. or encoder.
    body = {k: v for k, v in raw.items() if k.startswith("vit.") and k not in (
        "vit.embeddings.position_embeddings", "vit.embeddings.detection_tokens", *mids)}
    body["vit.embeddings.position_embeddings"] = pos[:, :-n]
    backbone, _ = to_vitkit(body)
    sd = {f"backbone.{k}": v for k, v in backbone.items()}
    sd["det_token"], sd["det_pos"] = raw["vit.embeddings.detection_tokens"], pos[:, -n:]
    mid = raw[mids[0]] if mids else None
    if mid is not None:
        sd["mid_pos"] = mid
    for theirs, ours in (("class_labels_classifier.", "class_head."), ("bbox_predictor.", "box_head.")):
        sd.update({ours + k[len(theirs):]: v for k, v in raw.items() if k.startswith(theirs)})
    preset, overrides = preset_for({**config, "model_type": "vit"})
    overrides["img_size"] = tuple(config.get("image_size", (512, 864)))
    labels = config.get("id2label") or {}
    names = [labels[k] for k in sorted(labels, key=int)] if labels else []
    classes = sd["class_head.layers.2.weight"].shape[0] - 1
    settings = dict(num_classes=classes, det_tokens=n, mid_positions=mid is not None)
    return DetectorFile(preset, overrides, "yolos", settings, sd, names)


def read_detector(path: str | os.PathLike) -> DetectorFile:
    """A detector's file in vitkit's names: a transformers YOLOS folder."""
    path = Path(path)
    if not path.exists():
        raise MissingFileError(f"{path} is not there: vitkit.load_detector reads a local folder (what "
                               "save_pretrained wrote, or a model's snapshot folder in the Hugging Face cache)")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path} is not a detector vitkit reads: expected a folder of transformers' "
                              "YolosForObjectDetection (config.json and model.safetensors)")
    return transformers_yolos(path)
