"""Depth estimators of other libraries in vitkit's names (``vitkit.models.depth``): transformers'
``DepthAnythingForDepthEstimation`` folders (``config.json`` and the weights, as ``save_pretrained`` writes them, or a
model's snapshot folder such as ``depth-anything/Depth-Anything-V2-Small-hf`` in the Hugging Face cache)."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

from vitkit.errors import MissingFileError

from .detection import _weights
from .files import CheckpointError
from .formats import to_vitkit
from .hf_config import preset_for

REASSEMBLE = [4, 2, 1, 0.5]  # DPT's: the four maps at 4x, 2x, 1x and 1/2x of the patch grid


@dataclass
class DepthFile:
    """What a depth estimator's file holds: the backbone's preset and overrides, the head's settings (``indices``,
    ``channels``, ``reassemble``, ``hidden``, ``kind``, ``max_depth``) and the weights in vitkit's names."""

    preset: str
    overrides: dict[str, Any]
    settings: dict[str, Any]
    state_dict: dict[str, Tensor]


def _neck(theirs: str) -> str | None:
    """A transformers Depth Anything neck or head key in vitkit's names (``DPTDepthHead``'s), None for another."""
    rules = [(r"neck\.reassemble_stage\.layers\.(\d)\.projection\.", r"head.projects.\1."),
             (r"neck\.reassemble_stage\.layers\.(\d)\.resize\.", r"head.resamples.\1."),
             (r"neck\.convs\.(\d)\.", r"head.levels.\1."),
             (r"head\.conv(\d)\.", r"head.conv\1.")]
    for pattern, ours in rules:
        m = re.match(pattern, theirs)
        if m:
            return m.expand(ours) + theirs[m.end():]
    m = re.match(r"neck\.fusion_stage\.layers\.(\d)\.(projection|residual_layer(\d)\.convolution(\d))\.", theirs)
    if m:  # theirs fuse from the coarsest as layer 0; ours are indexed by level, the coarsest 3
        level = 3 - int(m.group(1))
        if m.group(2) == "projection":
            part = "project"
        else:
            part = f"{'skip' if m.group(3) == '1' else 'refine'}.conv{m.group(4)}"
        return f"head.fusions.{level}.{part}.{theirs[m.end():]}"
    return None


def transformers_depth_anything(folder: str | os.PathLike) -> DepthFile:
    """A folder that transformers' ``DepthAnythingForDepthEstimation.save_pretrained`` wrote: a DINOv2 backbone under
    ``backbone.`` (its maps read at ``out_indices``, through its final norm) and DPT's neck and depth head."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    if config.get("model_type") != "depth_anything":
        raise CheckpointError(f"{folder}/config.json has model_type={config.get('model_type')!r}, not "
                              "'depth_anything'")
    backbone_config = config.get("backbone_config") or {}
    if not str(backbone_config.get("model_type", "")).startswith("dinov2") or config.get("backbone"):
        kind = backbone_config.get("model_type") or config.get("backbone")
        raise CheckpointError(f"{folder}: a Depth Anything on a {kind!r} backbone; vitkit reads the DINOv2 ones "
                              "(Depth Anything V1 and V2)")
    if [float(f) for f in config.get("reassemble_factors", REASSEMBLE)] != REASSEMBLE or \
            config.get("head_in_index", -1) != -1 or not backbone_config.get("apply_layernorm", True):
        raise CheckpointError(f"{folder}: reassemble_factors {config.get('reassemble_factors')}, head_in_index "
                              f"{config.get('head_in_index')}: vitkit's DPT reads {REASSEMBLE} and the finest map")
    raw = _weights(folder)
    body = {k[len("backbone."):]: v for k, v in raw.items() if k.startswith("backbone.")}
    backbone, _ = to_vitkit(body)
    sd = {f"backbone.{k}": v for k, v in backbone.items()}
    unknown = []
    for k, v in raw.items():
        if k.startswith("backbone."):
            continue
        ours = _neck(k)
        if ours is None:
            unknown.append(k)
        else:
            sd[ours] = v
    if unknown:
        raise CheckpointError(f"{folder}: weights a Depth Anything model has no place for: {', '.join(unknown[:4])}")
    preset, overrides = preset_for(backbone_config)
    overrides["img_size"] = backbone_config.get("image_size", 518)
    overrides["pos_antialias"] = False  # transformers' DINOv2 resamples its positions by plain bicubic
    stages = backbone_config.get("out_indices") or [len(backbone_config.get("stage_names", [])) - 1]
    kind = config.get("depth_estimation_type", "relative")
    settings = dict(indices=[int(i) - 1 for i in stages], channels=config.get("fusion_hidden_size", 256),
                    reassemble=list(config.get("neck_hidden_sizes", [])), hidden=config.get("head_hidden_size", 32),
                    kind=kind, max_depth=float(config.get("max_depth") or 1.0))
    return DepthFile(preset, overrides, settings, sd)


def read_depth_file(path: str | os.PathLike) -> DepthFile:
    """A depth estimator's file in vitkit's names: a transformers Depth Anything folder."""
    path = Path(path)
    if not path.exists():
        raise MissingFileError(f"{path} is not there: vitkit.load_depth_estimator reads a local folder (what "
                               "save_pretrained wrote, or a model's snapshot folder in the Hugging Face cache)")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path} is not a depth estimator vitkit reads: expected a folder of transformers' "
                              "DepthAnythingForDepthEstimation (config.json and model.safetensors)")
    return transformers_depth_anything(path)
