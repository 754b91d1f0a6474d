"""Segmentation models of other libraries in vitkit's names (``vitkit.models.segmentation``, mmsegmentation's):
transformers' ``UperNetForSemanticSegmentation`` on a Swin backbone (its folder: ``config.json`` and the weights),
mmsegmentation's UperNet-Swin checkpoints (``upernet_swin_tiny_patch4_window7_512x512_160k_ade20k_*.pth``), and
Meta's DINOv2 linear heads (``dinov2_vits14_ade20k_linear_head.pth``: an mmsegmentation checkpoint of a
``BNHead``)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
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


def is_mmseg_upernet_swin(raw: dict[str, Tensor]) -> bool:
    return "backbone.stages.0.blocks.0.attn.w_msa.qkv.weight" in raw and "decode_head.bottleneck.conv.weight" in raw


def _merge_order(x: Tensor) -> Tensor:
    """A patch merging's weight (out, 4C) or norm (4C,) from mmsegmentation's channel order (``nn.Unfold``'s: each
    channel's four pixels together) to the original Swin's (the four pixels' channels one after another), which
    timm, transformers and vitkit keep; mmsegmentation's model converters go the other way."""
    shape = x.shape
    x = x.reshape(-1, shape[-1] // 4, 4)
    return x[:, :, [0, 2, 1, 3]].transpose(1, 2).reshape(shape)


def _mmseg_swin_as_transformers(raw: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """mmsegmentation's Swin backbone (``backbone.stages.I.blocks.J.attn.w_msa...``) in transformers' Swin names,
    and the transformers config its shapes give."""
    out: dict[str, Tensor] = {}
    depths: list[int] = []
    heads: list[int] = []
    i = 0
    while f"backbone.stages.{i}.blocks.0.norm1.weight" in raw:
        j = 0
        while f"backbone.stages.{i}.blocks.{j}.norm1.weight" in raw:
            old, new = f"backbone.stages.{i}.blocks.{j}.", f"encoder.layers.{i}.blocks.{j}."
            qkv, bias = raw[old + "attn.w_msa.qkv.weight"], raw[old + "attn.w_msa.qkv.bias"]
            for k, (w, b) in zip(("query", "key", "value"), zip(qkv.chunk(3), bias.chunk(3), strict=True),
                                 strict=True):
                out[f"{new}attention.self.{k}.weight"], out[f"{new}attention.self.{k}.bias"] = w, b
            for src, dst in (("norm1", "layernorm_before"), ("norm2", "layernorm_after"),
                             ("attn.w_msa.proj", "attention.output.dense"), ("ffn.layers.0.0", "intermediate.dense"),
                             ("ffn.layers.1", "output.dense")):
                for part in ("weight", "bias"):
                    out[f"{new}{dst}.{part}"] = raw[f"{old}{src}.{part}"]
            table = raw[old + "attn.w_msa.relative_position_bias_table"]
            out[f"{new}attention.self.relative_position_bias_table"] = table
            j += 1
        heads.append(table.shape[1])
        depths.append(j)
        for part in ("reduction.weight", "norm.weight", "norm.bias"):
            key = f"backbone.stages.{i}.downsample.{part}"
            if key in raw:
                out[f"encoder.layers.{i}.downsample.{part}"] = _merge_order(raw[key])
        i += 1
    if not depths:
        raise KeyError("backbone.stages.0.blocks.0.norm1.weight")
    proj = raw["backbone.patch_embed.projection.weight"]
    for src, dst in (("projection.weight", "patch_embeddings.projection.weight"),
                     ("projection.bias", "patch_embeddings.projection.bias"),
                     ("norm.weight", "norm.weight"), ("norm.bias", "norm.bias")):
        out[f"embeddings.{dst}"] = raw[f"backbone.patch_embed.{src}"]
    window = round((table.shape[0] ** 0.5 + 1) / 2)
    config = dict(model_type="swin", embed_dim=proj.shape[0], patch_size=proj.shape[-1], depths=depths,
                  num_heads=heads, window_size=window, num_channels=proj.shape[1], image_size=224)
    return out, config


def mmseg_upernet(raw: dict[str, Tensor]) -> SegmenterFile:
    """An mmsegmentation UperNet-Swin checkpoint's weights (``backbone.stages...``, ``backbone.norm0-3``,
    ``decode_head.*``, ``auxiliary_head.*``)."""
    swin, config = _mmseg_swin_as_transformers(raw)
    body, _ = to_vitkit(swin)
    sd = {f"backbone.{k}": v for k, v in body.items()}
    for i in range(len(config["depths"])):
        for part in ("weight", "bias"):
            sd[f"stage_norms.{i}.{part}"] = raw[f"backbone.norm{i}.{part}"]
    width = sd["stage_norms.0.weight"].shape[0] * 2 ** (len(config["depths"]) - 1)
    sd.setdefault("backbone.norm.weight", torch.ones(width))  # the final norm, which mmsegmentation's Swin has not:
    sd.setdefault("backbone.norm.bias", torch.zeros(width))  # the identity (a segmenter reads the stage norms)
    heads = {k: v for k, v in raw.items() if k.startswith(("decode_head.", "auxiliary_head.")) and ".loss" not in k}
    sd.update(heads)
    pools = len({k.split(".")[2] for k in heads if k.startswith("decode_head.psp_modules.")})
    head_args = dict(channels=raw["decode_head.bottleneck.conv.weight"].shape[0],
                     pool_scales=(1, 2, 3, 6) if pools == 4 else tuple(range(1, pools + 1)))
    aux = "auxiliary_head.conv_seg.weight" in raw
    aux_args = dict(channels=raw["auxiliary_head.convs.0.conv.weight"].shape[0],
                    num_convs=len({k.split(".")[2] for k in heads if k.startswith("auxiliary_head.convs.")}),
                    concat_input="auxiliary_head.conv_cat.conv.weight" in raw) if aux else {}
    preset, overrides = preset_for(config)
    return SegmenterFile(preset, overrides, "upernet", head_args, sd, aux, aux_args, [])


def read_segmenter(path: str | os.PathLike) -> SegmenterFile:
    """A whole segmentation model's folder or file: transformers' UperNet folder, or an mmsegmentation UperNet-Swin
    checkpoint (its class names from its ``meta`` where it has them)."""
    path = Path(os.path.expanduser(path))
    if not path.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    if path.is_dir():
        return _backbone_rule(transformers_upernet(path))
    loaded = read_file(path)
    raw = unwrap(loaded)
    if not is_mmseg_upernet_swin(raw):
        raise CheckpointError(f"{path} is neither a transformers UperNet folder nor an mmsegmentation UperNet-Swin "
                              f"checkpoint (backbone.stages..., decode_head...); it holds {sorted(raw)[:3]}")
    try:
        found = mmseg_upernet(raw)
    except KeyError as e:  # a file cut short, or a backbone other than Swin's
        raise CheckpointError(f"{path}: an mmsegmentation UperNet-Swin checkpoint without {e.args[0]}") from None
    meta = loaded.get("meta") if isinstance(loaded, dict) else None
    classes = (meta or {}).get("CLASSES") or ((meta or {}).get("dataset_meta") or {}).get("classes")
    if classes:
        found.class_names = [str(c) for c in classes]
    return _backbone_rule(found)


def _backbone_rule(found: SegmenterFile) -> SegmenterFile:
    """transformers' ``SwinBackbone`` and mmsegmentation's Swin window every map with the configured window and shift
    whatever its size (padded to whole windows), where their classifiers shrink a window larger than the map: the
    segmenter's backbone is built to the rule its weights were trained with."""
    found.overrides = {**found.overrides, "always_partition": True}
    return found


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
