"""Segmentation models of other libraries in vitkit's names (``vitkit.models.segmentation``, mmsegmentation's):
transformers' ``UperNetForSemanticSegmentation`` on a Swin backbone (its folder: ``config.json`` and the weights),
and Meta's DINOv2 linear heads (``dinov2_vits14_ade20k_linear_head.pth``: an mmsegmentation checkpoint of a
``BNHead``)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor

from .files import CheckpointError, read_file
from .formats import to_vitkit, unwrap
from .hf_config import preset_for


@dataclass
class SegmenterFile:
    """What a segmentation file holds: the backbone's preset and overrides, the head and its arguments, and the
    weights in vitkit's names (``backbone.``, ``decode_head.``, ``auxiliary_head.``, ``stage_norms.``)."""

    preset: str | None
    overrides: dict[str, Any]
    head: str
    head_args: dict[str, Any]
    state_dict: dict[str, Tensor]
    auxiliary: bool = False
    aux_args: dict[str, Any] = field(default_factory=dict)
    class_names: list[str] = field(default_factory=list)


def _head_names(sd: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """transformers' ConvModules (``batch_norm``) and classifier (``classifier``) in mmsegmentation's names."""
    out = {}
    for key, value in sd.items():
        if key.startswith(prefix):
            key = key.replace(".batch_norm.", ".bn.").replace(f"{prefix}classifier.", f"{prefix}conv_seg.")
            out[key] = value
    return out


def transformers_upernet(folder: str | os.PathLike) -> SegmenterFile:
    """A folder that transformers' ``UperNetForSemanticSegmentation.save_pretrained`` wrote, with a Swin backbone."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    if config.get("model_type") != "upernet":
        raise CheckpointError(f"{folder}/config.json has model_type={config.get('model_type')!r}, not 'upernet'")
    backbone = config.get("backbone_config") or {}
    if backbone.get("model_type") != "swin":
        raise CheckpointError(f"{folder}: an UperNet on a {backbone.get('model_type')!r} backbone; vitkit reads "
                              "UperNet on Swin (model_type 'swin')")
    weights = next((folder / n for n in ("model.safetensors", "pytorch_model.bin") if (folder / n).exists()), None)
    if weights is None:
        raise CheckpointError(f"{folder} has config.json but no model.safetensors or pytorch_model.bin")
    raw = unwrap(read_file(weights))
    stages = backbone.get("out_features") or ["stage1", "stage2", "stage3", "stage4"]
    if stages != ["stage1", "stage2", "stage3", "stage4"]:
        raise CheckpointError(f"{folder}: the backbone gives {stages}; vitkit's UperNet reads all four Swin stages")
    # the files name the backbone ``backbone.embeddings...`` (transformers 4, and 5 on save), ``backbone.swin...`` in
    # memory under transformers 5
    body, _ = to_vitkit({k.removeprefix("backbone."): v for k, v in raw.items()
                         if k.startswith("backbone.") and not k.startswith("backbone.hidden_states_norms.")})
    sd = {f"backbone.{k}": v for k, v in body.items()}
    for i, stage in enumerate(stages):
        for part in ("weight", "bias"):
            sd[f"stage_norms.{i}.{part}"] = raw[f"backbone.hidden_states_norms.{stage}.{part}"]
    sd.update(_head_names(raw, "decode_head."))
    aux = any(k.startswith("auxiliary_head.") for k in raw)
    sd.update(_head_names(raw, "auxiliary_head."))
    preset, overrides = preset_for(backbone)
    head_args = dict(channels=config.get("hidden_size", 512),
                     pool_scales=tuple(config.get("pool_scales", (1, 2, 3, 6))))
    aux_args = dict(channels=config.get("auxiliary_channels", 256), num_convs=config.get("auxiliary_num_convs", 1),
                    concat_input=config.get("auxiliary_concat_input", False)) if aux else {}
    labels = config.get("id2label") or {}
    names = [labels[k] for k in sorted(labels, key=int)] if labels else []
    return SegmenterFile(preset, overrides, "upernet", head_args, sd, aux, aux_args, names)


def dinov2_linear_head(path: str | os.PathLike, embed_dim: int) -> tuple[dict[str, Tensor], int]:
    """Meta's DINOv2 linear segmentation head (an mmsegmentation checkpoint of ``decode_head.bn`` and
    ``decode_head.conv_seg``) for a backbone of width ``embed_dim``: the head's weights in vitkit's names and
    the number of layers whose maps it concatenates (1, or 4 for Meta's "ms" heads)."""
    raw = unwrap(read_file(Path(path)))
    sd = {k: v for k, v in raw.items() if k.startswith("decode_head.") and not k.startswith("decode_head.loss")}
    if "decode_head.conv_seg.weight" not in sd or "decode_head.bn.running_mean" not in sd:
        raise CheckpointError(f"{path} is not a DINOv2 linear head (decode_head.bn, decode_head.conv_seg); it holds "
                              f"{sorted(raw)[:4]}")
    width = sd["decode_head.conv_seg.weight"].shape[1]
    if width % embed_dim:
        raise CheckpointError(f"{path}: a head over {width} channels does not fit a backbone of width {embed_dim} "
                              f"(it takes 1 or 4 layers of that width)")
    return sd, width // embed_dim
