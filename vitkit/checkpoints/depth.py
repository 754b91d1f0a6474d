"""Depth estimators of other libraries in vitkit's names (``vitkit.models.depth``): transformers'
``DepthAnythingForDepthEstimation`` and ``DPTForDepthEstimation`` folders (``config.json`` and the weights, as
``save_pretrained`` writes them, or a model's snapshot folder such as ``depth-anything/Depth-Anything-V2-Small-hf``
in the Hugging Face cache), and Meta's DINOv2 depth heads (``dinov2_vits14_nyu_dpt_head.pth``, ``..._linear4_head.pth``;
the backbone comes from its own file)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

from vitkit.errors import MissingFileError, UsageError

from .detection import _weights
from .files import CheckpointError, interpreted, read_config, read_file
from .formats import to_vitkit, unwrap
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
    unused: tuple[str, ...] = ()  # weights the model has and never runs (DPT's first fusion's skip unit)
    backbone_file: bool = False  # the file holds the head alone: the backbone comes from its own file


def _neck(theirs: str) -> str | None:
    """A transformers Depth Anything or DPT neck or head key in vitkit's names (``DPTDepthHead``'s), None for
    another."""
    rules = [(r"neck\.reassemble_stage\.layers\.(\d)\.projection\.", r"head.projects.\1."),
             (r"neck\.reassemble_stage\.layers\.(\d)\.resize\.", r"head.resamples.\1."),
             (r"neck\.reassemble_stage\.readout_projects\.(\d)\.0\.", r"head.readouts.\1.0."),
             (r"neck\.convs\.(\d)\.", r"head.levels.\1."),
             (r"head\.conv(\d)\.", r"head.conv\1."),
             (r"head\.projection\.", "head.project."),
             (r"head\.head\.([024])\.", lambda m: f"head.conv{int(m.group(1)) // 2 + 1}.")]
    for pattern, ours in rules:
        m = re.match(pattern, theirs)
        if m:
            return (ours(m) if callable(ours) else m.expand(ours)) + theirs[m.end():]
    m = re.match(r"neck\.fusion_stage\.layers\.(\d)\.(projection|residual_layer(\d)\.convolution(\d))\.", theirs)
    if m:  # theirs fuse from the coarsest as layer 0; ours are indexed by level, the coarsest 3
        level = 3 - int(m.group(1))
        if m.group(2) == "projection":
            part = "project"
        else:
            part = f"{'skip' if m.group(3) == '1' else 'refine'}.conv{m.group(4)}"
        return f"head.fusions.{level}.{part}.{theirs[m.end():]}"
    return None


def _head_weights(folder: Path, raw: dict[str, Tensor], sd: dict[str, Tensor], skip: str) -> None:
    """The neck's and head's weights of ``raw`` (those not under ``skip``) into ``sd`` in vitkit's names."""
    unknown = []
    for k, v in raw.items():
        if k.startswith(skip):
            continue
        ours = _neck(k)
        if ours is None:
            unknown.append(k)
        else:
            sd[ours] = v
    if unknown:
        raise CheckpointError(f"{folder}: weights a depth model has no place for: {', '.join(unknown[:4])}")


def transformers_depth_anything(folder: str | os.PathLike) -> DepthFile:
    """A folder that transformers' ``DepthAnythingForDepthEstimation.save_pretrained`` wrote: a DINOv2 backbone under
    ``backbone.`` (its maps read at ``out_indices``, through its final norm) and DPT's neck and depth head."""
    folder = Path(folder)
    config = read_config(folder)
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
    sd = _backbone(raw, "backbone.")
    _head_weights(folder, raw, sd, "backbone.")
    preset, overrides = preset_for(backbone_config)
    overrides["img_size"] = backbone_config.get("image_size", 518)
    overrides["pos_antialias"] = False  # transformers' DINOv2 resamples its positions by plain bicubic
    stages = backbone_config.get("out_indices") or [len(backbone_config.get("stage_names", [])) - 1]
    kind = config.get("depth_estimation_type", "relative")
    settings = dict(indices=[int(i) - 1 for i in stages], channels=config.get("fusion_hidden_size", 256),
                    reassemble=list(config.get("neck_hidden_sizes", [])), hidden=config.get("head_hidden_size", 32),
                    kind=kind, max_depth=float(config.get("max_depth") or 1.0))
    return DepthFile(preset, overrides, settings, sd)


def _backbone(raw: dict[str, Tensor], prefix: str, rename: str = "") -> dict[str, Tensor]:
    """The weights under ``prefix`` as a vitkit backbone's, under ``backbone.`` (``rename``: the prefix they
    are read under, where the format needs one: a DPT's ViT is transformers' ViT under ``vit.``)."""
    body = {rename + k[len(prefix):]: v for k, v in raw.items() if k.startswith(prefix)}
    backbone, _ = to_vitkit(body)
    return {f"backbone.{k}": v for k, v in backbone.items()}


def transformers_dpt(folder: str | os.PathLike) -> DepthFile:
    """A folder that transformers' ``DPTForDepthEstimation.save_pretrained`` wrote: DPT's own ViT under ``dpt.``
    (Intel's ``dpt-large``: the blocks' outputs read without the final norm, positions resampled bilinearly) or a
    DINOv2 backbone under ``backbone.`` (Meta's ``dpt-dinov2-*``), the class token read out by ``readout_type``,
    fusions that double, and DPT's depth head. DPT-Hybrid (a BiT stem) and other backbones are refused."""
    folder = Path(folder)
    config = read_config(folder)
    if config.get("model_type") != "dpt":
        raise CheckpointError(f"{folder}/config.json has model_type={config.get('model_type')!r}, not 'dpt'")
    backbone_config = config.get("backbone_config") or {}
    if config.get("is_hybrid") or config.get("backbone") or (backbone_config and not str(
            backbone_config.get("model_type", "")).startswith("dinov2")):
        kind = "DPT-Hybrid (BiT)" if config.get("is_hybrid") else backbone_config.get("model_type") or \
            config.get("backbone")
        raise CheckpointError(f"{folder}: a DPT on a {kind} backbone; vitkit reads DPT's own ViT and DINOv2")
    if [float(f) for f in config.get("reassemble_factors", REASSEMBLE)] != REASSEMBLE or \
            config.get("head_in_index", -1) != -1 or config.get("use_batch_norm_in_fusion_residual") or \
            config.get("neck_ignore_stages"):
        raise CheckpointError(f"{folder}: reassemble_factors {config.get('reassemble_factors')}, head_in_index "
                              f"{config.get('head_in_index')}, batch norm in the fusions "
                              f"{config.get('use_batch_norm_in_fusion_residual')}: vitkit's DPT reads {REASSEMBLE}, "
                              "the finest map and fusions without batch norm")
    raw = _weights(folder)
    bias = config.get("use_bias_in_fusion_residual")
    settings = dict(channels=config.get("fusion_hidden_size", 256), reassemble=list(config["neck_hidden_sizes"]),
                    style="dpt", readout=config.get("readout_type", "project"),
                    project=bool(config.get("add_projection")), bias=True if bias is None else bool(bias))
    if backbone_config:
        sd = _backbone(raw, "backbone.")
        _head_weights(folder, raw, sd, "backbone.")
        preset, overrides = preset_for(backbone_config)
        overrides.update(img_size=backbone_config.get("image_size", 518), pos_antialias=False)
        stages = backbone_config.get("out_indices") or [backbone_config.get("num_hidden_layers", 12)]
        settings.update(indices=[int(i) - 1 for i in stages], norm=bool(backbone_config.get("apply_layernorm")),
                        kind="metric", max_depth=None)  # Meta's NYU and KITTI heads: metres, not clamped
    else:
        sd = _backbone(raw, "dpt.", rename="vit.")
        _head_weights(folder, raw, sd, "dpt.")
        preset, overrides = preset_for({**config, "model_type": "vit"})
        overrides.update(img_size=config.get("image_size", 384), pos_interp="bilinear", pos_antialias=False)
        settings.update(indices=list(config.get("backbone_out_indices", [2, 5, 8, 11])), norm=False,
                        kind="relative")  # MiDaS's inverse depth
    return DepthFile(preset, overrides, settings, sd)


DINOV2_LAYERS = {12: [2, 5, 8, 11], 24: [4, 11, 17, 23], 40: [9, 19, 29, 39]}  # Meta's out_index by depth


def dinov2_depth_head(path: str | os.PathLike, max_depth: float | None = None) -> DepthFile:
    """A depth head file of Meta's DINOv2 (``dinov2_vit{s,b,l,g}14_{nyu,kitti}_{dpt,linear,linear4}_head.pth``:
    mmcv's names under ``decode_head.``): DPT (readout projected, fusions without biases, a 3x3 projection, depth
    ``ReLU + 0.001`` clamped to ``max_depth``) or a linear head with 256 depth bins (:class:`BinsDepthHead`), on
    blocks' outputs without the final norm. ``max_depth``: 80 for a KITTI file, 10 otherwise (Meta's), or given.
    The settings leave the backbone out (``preset`` empty): it comes from its own file."""
    path = Path(path)
    raw = unwrap(read_file(path))
    if max_depth is None:
        max_depth = 80.0 if "kitti" in path.name.lower() else 10.0
    sd: dict[str, Tensor] = {}
    if "decode_head.conv_depth.weight" in raw:  # the linear heads: 1 layer or 4, each with its class token
        bins, width = raw["decode_head.conv_depth.weight"].shape[:2]
        sd = {"head.conv_depth.weight": raw["decode_head.conv_depth.weight"],
              "head.conv_depth.bias": raw["decode_head.conv_depth.bias"]}
        return DepthFile("", {}, dict(head="bins", bins=bins, min_depth=1e-3, max_depth=max_depth, norm=False),
                         sd, backbone_file=True)
    rules = [(r"reassemble_blocks\.projects\.(\d)\.conv\.", r"projects.\1."),
             (r"reassemble_blocks\.readout_projects\.(\d)\.0\.", r"readouts.\1.0."),
             (r"reassemble_blocks\.resize_layers\.(\d)\.", r"resamples.\1."),
             (r"convs\.(\d)\.conv\.", r"levels.\1."),
             (r"project\.conv\.", "project."),
             (r"conv_depth\.head\.([024])\.", lambda m: f"conv{int(m.group(1)) // 2 + 1}."),
             (r"fusion_blocks\.(\d)\.project\.conv\.", lambda m: f"fusions.{3 - int(m.group(1))}.project."),
             (r"fusion_blocks\.(\d)\.res_conv_unit(\d)\.conv(\d)\.conv\.",
              lambda m: f"fusions.{3 - int(m.group(1))}.{'skip' if m.group(2) == '1' else 'refine'}.conv{m.group(3)}.")]
    unknown = []
    for k, v in raw.items():
        name = k.removeprefix("decode_head.")
        for pattern, ours in rules:
            m = re.match(pattern, name)
            if m:
                sd["head." + (ours(m) if callable(ours) else m.expand(ours)) + name[m.end():]] = v
                break
        else:
            unknown.append(k)
    if unknown or "head.projects.0.weight" not in sd:
        raise CheckpointError(f"{path} is not a DINOv2 depth head vitkit reads (Meta's DPT or linear heads, "
                              f"decode_head.*): {', '.join(unknown[:4]) or 'no decode_head weights'}")
    reassemble = [sd[f"head.projects.{i}.weight"].shape[0] for i in range(4)]
    settings = dict(channels=sd["head.levels.0.weight"].shape[0], reassemble=reassemble, style="dpt",
                    readout="project" if "head.readouts.0.0.weight" in sd else "ignore", project=True, bias=False,
                    min_depth=1e-3, kind="metric", max_depth=max_depth, norm=False)
    return DepthFile("", {}, settings, sd, unused=("head.fusions.3.skip.",), backbone_file=True)


def head_indices(found: DepthFile, depth: int, dim: int) -> list[int]:
    """The blocks a DINOv2 depth head file reads on a backbone of ``depth`` blocks ``dim`` wide: Meta's four
    (``DINOV2_LAYERS``), or the last alone for a one-layer linear head; a head made for another width is refused."""
    if found.settings.get("head") == "bins":
        width = found.state_dict["head.conv_depth.weight"].shape[1]
        layers = width // (2 * dim) if width % (2 * dim) == 0 else 0
    else:
        width = found.state_dict["head.projects.0.weight"].shape[1]
        layers = 4 if width == dim else 0
    if layers not in (1, 4):
        raise CheckpointError(f"this DINOv2 depth head reads maps {width} wide in all; the backbone's are {dim} wide "
                              f"(its class token doubles them): give the backbone the head was trained on")
    if layers == 1:
        return [depth - 1]
    return DINOV2_LAYERS.get(depth) or [(k + 1) * depth // 4 - 1 for k in range(4)]


def read_depth_file(path: str | os.PathLike, max_depth: float | None = None) -> DepthFile:
    """A depth estimator's file in vitkit's names: a transformers Depth Anything or DPT folder, or a DINOv2 depth
    head file (``max_depth`` overrides the one its name implies)."""
    path = Path(path)
    if not path.exists():
        raise MissingFileError(f"{path} is not there: vitkit.load_depth_estimator reads a local folder (what "
                               "save_pretrained wrote, or a model's snapshot folder in the Hugging Face cache) or a "
                               "DINOv2 depth head file")
    if max_depth is not None and not max_depth > 0:
        raise UsageError(f"max_depth is a DINOv2 head's deepest output, above 0 (NYU: 10, KITTI: 80), got {max_depth}")
    if path.is_file():
        return interpreted(path, lambda: dinov2_depth_head(path, max_depth))
    if max_depth is not None:
        raise UsageError(f"max_depth= is for a DINOv2 depth head file; {path} records its own range")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path} is not a depth estimator vitkit reads: expected a folder of transformers' "
                              "DepthAnythingForDepthEstimation or DPTForDepthEstimation (config.json and "
                              "model.safetensors), or a DINOv2 depth head file")
    model_type = read_config(path).get("model_type")
    if model_type not in ("dpt", "depth_anything"):
        raise CheckpointError(f"{path}/config.json has model_type={model_type!r}; vitkit reads depth estimators of "
                              "model_type 'depth_anything' and 'dpt'")
    return interpreted(path, lambda: transformers_dpt(path) if model_type == "dpt" else
                       transformers_depth_anything(path))
