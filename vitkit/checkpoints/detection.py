"""Detectors of other libraries in vitkit's names (``vitkit.models.detection``, ``vitkit.models.rf_detr``):
transformers' ``YolosForObjectDetection`` and ``RfDetrForObjectDetection`` folders (``config.json`` and the weights,
as ``save_pretrained`` writes them). transformers writes RF-DETR's weights in RF-DETR's own names (``backbone.0.``,
``transformer.``), which are the names read here."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor

from vitkit.errors import MissingFileError

from .files import CheckpointError, interpreted, read_config, read_file
from .formats import fuse_qkv, rename, rename_key, to_vitkit, unwrap
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
    unused: tuple[str, ...] = ()  # weights the model has and never runs (LW-DETR's backbone's final norm)


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
    config = read_config(folder)
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


RF_DETR_NAMES = [  # RF-DETR's names (as transformers writes them) -> vitkit.models.rf_detr.RFDETR's
    (r"^backbone\.0\.projector\.stages\.(\d+)\.0\.cv([12])\.bn\.", r"projector.\1.conv\2.norm."),
    (r"^backbone\.0\.projector\.stages\.(\d+)\.0\.cv([12])\.", r"projector.\1.conv\2."),
    (r"^backbone\.0\.projector\.stages\.(\d+)\.0\.m\.(\d+)\.cv([12])\.bn\.",
     r"projector.\1.bottlenecks.\2.conv\3.norm."),
    (r"^backbone\.0\.projector\.stages\.(\d+)\.0\.m\.(\d+)\.cv([12])\.", r"projector.\1.bottlenecks.\2.conv\3."),
    (r"^backbone\.0\.projector\.stages\.(\d+)\.1\.", r"projector.\1.norm."),
    (r"^backbone\.0\.projector\.stages_sampling\.(\d+)\.(\d+)\.(\d+)\.bn\.", r"projector.\1.samplers.\2.\3.norm."),
    (r"^backbone\.0\.projector\.stages_sampling\.(\d+)\.(\d+)\.(\d+)\.", r"projector.\1.samplers.\2.\3."),
    (r"^refpoint_embed\.weight$", "reference_embed"),
    (r"^query_feat\.weight$", "query_feat"),
    (r"^transformer\.decoder\.layers\.(\d+)\.self_attn\.out_proj\.", r"layers.\1.self_attn.proj."),
    (r"^transformer\.decoder\.layers\.(\d+)\.norm1\.", r"layers.\1.self_attn_norm."),
    (r"^transformer\.decoder\.layers\.(\d+)\.norm2\.", r"layers.\1.cross_attn_norm."),
    (r"^transformer\.decoder\.layers\.(\d+)\.norm3\.", r"layers.\1.norm."),
    (r"^transformer\.decoder\.layers\.(\d+)\.linear([12])\.", r"layers.\1.fc\2."),
    (r"^transformer\.decoder\.layers\.(\d+)\.cross_attn\.", r"layers.\1.cross_attn."),
    (r"^transformer\.decoder\.norm\.", "decoder_norm."),
    (r"^transformer\.decoder\.ref_point_head\.", "ref_point_head."),
    (r"^transformer\.enc_output\.(\d+)\.", r"enc_output.\1."),
    (r"^transformer\.enc_output_norm\.(\d+)\.", r"enc_output_norm.\1."),
    (r"^transformer\.enc_out_class_embed\.(\d+)\.", r"enc_class.\1."),
    (r"^transformer\.enc_out_bbox_embed\.(\d+)\.", r"enc_box.\1."),
    (r"^class_embed\.", "class_head."),
    (r"^bbox_embed\.", "box_head."),
]
BACKBONE = "backbone.0.encoder.encoder."
RF_DETR_LEVELS = {"P3": 2.0, "P4": 1.0, "P5": 0.5}  # RF-DETR's projector levels -> their scale of the patch grid


def _refuse(folder: Path, config: dict, expected: dict[str, Any]) -> None:
    wrong = {k: config.get(k) for k, v in expected.items() if config.get(k, v) != v}
    if wrong:
        raise CheckpointError(f"{folder}: an RF-DETR with {wrong}; vitkit builds "
                              f"{ {k: expected[k] for k in wrong} }")


def _rf_detr_weights(where: Path, raw: dict[str, Tensor]) -> dict[str, Tensor]:
    """RF-DETR's weights in its own names (its ``.pth`` files' and transformers' folders') in vitkit's."""
    body = {k[len(BACKBONE):]: v for k, v in raw.items() if k.startswith(BACKBONE) and not k.endswith("mask_token")}
    if not body:
        raise CheckpointError(f"{where}: no {BACKBONE}* weights; not an RF-DETR checkpoint")
    backbone, _ = to_vitkit(body)
    sd = {f"backbone.{k}": v for k, v in backbone.items()}
    unknown = []
    for k, v in raw.items():
        if k.startswith(BACKBONE):
            continue
        m = re.match(r"^transformer\.decoder\.layers\.(\d+)\.self_attn\.in_proj_(weight|bias)$", k)
        if m:  # nn.MultiheadAttention's packed [q | k | v]
            for name, part in zip("qkv", v.chunk(3), strict=True):
                sd[f"layers.{m[1]}.self_attn.{name}_proj.{m[2]}"] = part
            continue
        ours = rename_key(k, RF_DETR_NAMES)
        if ours == k:
            unknown.append(k)
        else:
            sd[ours] = v
    if unknown:
        raise CheckpointError(f"{where}: weights an RF-DETR has no place for: {', '.join(unknown[:4])}")
    return sd


def transformers_rf_detr(folder: str | os.PathLike) -> DetectorFile:
    """A folder that transformers' ``RfDetrForObjectDetection.save_pretrained`` wrote: its windowed DINOv2, the
    projector, the two-stage heads of every query group and the decoder (``vitkit.models.rf_detr``)."""
    folder = Path(folder)
    config = read_config(folder)
    backbone_config = config.get("backbone_config") or {}
    if backbone_config.get("model_type") != "rf_detr_dinov2":
        raise CheckpointError(f"{folder}: an RF-DETR on a {backbone_config.get('model_type')!r} backbone; vitkit reads "
                              "the DINOv2 ones (rf_detr_dinov2)")
    _refuse(folder, config, {"activation_function": "silu", "decoder_activation_function": "relu",
                             "num_feature_levels": 1, "attention_bias": True})
    _refuse(folder, backbone_config, {"use_swiglu_ffn": False, "apply_layernorm": True, "num_register_tokens": 0})
    sd = _rf_detr_weights(folder, _weights(folder))
    preset, overrides = preset_for({**backbone_config, "model_type": "dinov2"})
    overrides["img_size"] = backbone_config.get("image_size", 518)
    stages = backbone_config.get("out_indices") or [backbone_config.get("num_hidden_layers", 12)]
    from vitkit.models.rf_detr import RFDETRConfig

    named = backbone_config.get("window_block_indexes")
    cfg = RFDETRConfig(
        out_indices=tuple(int(i) for i in stages), windows=int(backbone_config.get("num_windows", 4)),
        window_blocks=None if named is None else tuple(int(i) for i in named),
        d_model=config.get("d_model", 256), hidden_expansion=float(config.get("hidden_expansion", 0.5)),
        c2f_blocks=config.get("c2f_num_blocks", 3), projector_eps=float(config.get("layer_norm_eps", 1e-5)),
        decoder_layers=config.get("decoder_layers", 3), self_heads=config.get("decoder_self_attention_heads", 8),
        cross_heads=config.get("decoder_cross_attention_heads", 16), points=config.get("decoder_n_points", 4),
        ffn_dim=config.get("decoder_ffn_dim", 2048), queries=config.get("num_queries", 300),
        groups=config.get("group_detr", 13), dropout=float(config.get("dropout", 0.1)))
    labels = config.get("id2label") or {}
    names = [labels[k] for k in sorted(labels, key=int)] if labels else []
    settings = dict(num_classes=sd["class_head.weight"].shape[0], cfg=cfg)
    return DetectorFile(preset, overrides, "rf_detr", settings, sd, names)


def rf_detr_checkpoint(path: str | os.PathLike, raw: dict[str, Any]) -> DetectorFile:
    """A checkpoint RF-DETR's own code wrote (``rf-detr-base.pth``, a run's ``checkpoint_best_total.pth``): its
    weights under ``model`` in RF-DETR's names and its settings under ``args`` (an
    ``argparse.Namespace``, read without running code). The windowed DINOv2 without registers and the projector's
    levels of ``projector_scale`` (``[P4]`` for every released size; ``[P3, P5]`` for the deprecated Large) are read;
    others are refused."""
    path = Path(path)
    args = raw.get("args")
    args = vars(args) if hasattr(args, "__dict__") else dict(args or {})
    if not isinstance(raw.get("model"), dict) or not args:
        raise CheckpointError(f"{path}: an RF-DETR checkpoint holds its weights under 'model' and its settings under "
                              f"'args'; this one has {sorted(raw)[:6]}")
    encoder = str(args.get("encoder", ""))
    if not encoder.startswith("dinov2_windowed_") and encoder not in ("dinov2_small", "dinov2_base"):
        raise CheckpointError(f"{path}: an RF-DETR on the {encoder!r} encoder; vitkit reads the windowed DINOv2 "
                              "without registers (dinov2_windowed_small, dinov2_windowed_base)")
    levels = [str(p) for p in args.get("projector_scale") or ["P4"]]
    if not levels or set(levels) - set(RF_DETR_LEVELS) or levels != sorted(set(levels)):
        raise CheckpointError(f"{path}: an RF-DETR with projector_scale {levels}; vitkit reads levels of P3, P4 and "
                              "P5, each once, in that order")
    _refuse(path, args, {"layer_norm": True, "two_stage": True, "bbox_reparam": True,
                         "lite_refpoint_refine": True, "rms_norm": False, "segmentation_head": False})
    sd = _rf_detr_weights(path, raw["model"])
    dim = sd["backbone.cls_token"].shape[-1]
    patch = int(args.get("patch_size", 14))
    grid = int(args.get("positional_encoding_size", 37))
    depth = len({k.split(".")[2] for k in sd if k.startswith("backbone.blocks.")})
    preset, overrides = preset_for({"model_type": "dinov2", "hidden_size": dim, "num_hidden_layers": depth,
                                    "num_attention_heads": dim // 64, "patch_size": patch, "image_size": grid * patch,
                                    "mlp_ratio": sd["backbone.blocks.0.mlp.fc1.weight"].shape[0] / dim})
    overrides["img_size"] = grid * patch
    from vitkit.models.rf_detr import RFDETRConfig

    blocks = len({k.split(".")[3] for k in sd if k.startswith("projector.0.bottlenecks.")})
    named = args.get("window_block_indexes")
    cfg = RFDETRConfig(
        out_indices=tuple(int(i) for i in args.get("out_feature_indexes", (2, 5, 8, 11))),
        window_blocks=None if named is None else tuple(int(i) for i in named),
        windows=int(args.get("num_windows", 4)) if "windowed" in encoder else 1, d_model=int(args["hidden_dim"]),
        c2f_blocks=blocks, projector_eps=1e-6, decoder_layers=int(args.get("dec_layers", 3)),
        self_heads=int(args.get("sa_nheads", 8)), cross_heads=int(args.get("ca_nheads", 16)),
        points=int(args.get("dec_n_points", 2)), ffn_dim=int(args.get("dim_feedforward", 2048)),
        queries=int(args.get("num_queries", 300)), groups=int(args.get("group_detr", 13)),
        dropout=float(args.get("dropout", 0.0)), scales=tuple(RF_DETR_LEVELS[p] for p in levels), reduce_wide=False)
    names = [str(n) for n in args.get("class_names") or []]
    classes = sd["class_head.weight"].shape[0]
    return DetectorFile(preset, overrides, "rf_detr", dict(num_classes=classes, cfg=cfg),
                        sd, names if len(names) == classes else [])


LW_DETR_NAMES = [  # transformers' LW-DETR names (as save_pretrained writes them) -> vitkit.models.rf_detr.RFDETR's
    (r"^model\.backbone\.backbone\.encoder\.layer\.(\d+)\.attention\.attention\.", r"backbone.blocks.\1.attn."),
    (r"^model\.backbone\.backbone\.embeddings\.projection\.", "backbone.patch_embed.proj."),
    (r"^model\.backbone\.backbone\.encoder\.layer\.(\d+)\.attention\.output\.", r"backbone.blocks.\1.attn.proj."),
    (r"^model\.backbone\.backbone\.encoder\.layer\.(\d+)\.gamma_([12])$", r"backbone.blocks.\1.ls\2.gamma"),
    (r"^model\.backbone\.backbone\.encoder\.layer\.(\d+)\.intermediate\.", r"backbone.blocks.\1.mlp."),
    (r"^model\.backbone\.backbone\.encoder\.layer\.(\d+)\.layernorm_before\.", r"backbone.blocks.\1.norm1."),
    (r"^model\.backbone\.backbone\.encoder\.layer\.(\d+)\.layernorm_after\.", r"backbone.blocks.\1.norm2."),
    (r"^model\.backbone\.projector\.scale_layers\.(\d+)\.sampling_layers\.(\d+)\.layers\.",
     r"projector.\1.samplers.\2."),
    (r"^model\.backbone\.projector\.scale_layers\.(\d+)\.projector_layer\.", r"projector.\1."),
    (r"^model\.backbone\.projector\.scale_layers\.(\d+)\.layer_norm\.", r"projector.\1.norm."),
    (r"^model\.decoder\.layers\.(\d+)\.self_attn\.o_proj\.", r"layers.\1.self_attn.proj."),
    (r"^model\.decoder\.layers\.(\d+)\.self_attn\.([qkv]_proj)\.", r"layers.\1.self_attn.\2."),
    (r"^model\.decoder\.layers\.(\d+)\.self_attn_layer_norm\.", r"layers.\1.self_attn_norm."),
    (r"^model\.decoder\.layers\.(\d+)\.cross_attn\.", r"layers.\1.cross_attn."),
    (r"^model\.decoder\.layers\.(\d+)\.cross_attn_layer_norm\.", r"layers.\1.cross_attn_norm."),
    (r"^model\.decoder\.layers\.(\d+)\.mlp\.", r"layers.\1."),
    (r"^model\.decoder\.layers\.(\d+)\.layer_norm\.", r"layers.\1.norm."),
    (r"^model\.decoder\.layernorm\.", "decoder_norm."),
    (r"^model\.decoder\.ref_point_head\.", "ref_point_head."),
    (r"^model\.enc_output\.(\d+)\.", r"enc_output.\1."),
    (r"^model\.enc_output_norm\.(\d+)\.", r"enc_output_norm.\1."),
    (r"^model\.enc_out_class_embed\.(\d+)\.", r"enc_class.\1."),
    (r"^model\.enc_out_bbox_embed\.(\d+)\.", r"enc_box.\1."),
    (r"^model\.query_feat\.weight$", "query_feat"),
    (r"^model\.reference_point_embed\.weight$", "reference_embed"),
    (r"^class_embed\.", "class_head."),
    (r"^bbox_embed\.", "box_head."),
]
IMAGENET = dict(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))


def _lw_detr_weights(folder: Path, raw: dict[str, Tensor]) -> dict[str, Tensor]:
    """transformers' LW-DETR weights in vitkit's names (``LW_DETR_NAMES``; q, k and v joined, q's and v's biases
    apart: the keys have none)."""
    sd = fuse_qkv(rename(raw, LW_DETR_NAMES))
    pos = sd.pop("model.backbone.backbone.embeddings.position_embeddings", None)
    unknown = [k for k in sd if k.startswith("model.")]  # still in transformers' names
    if unknown or pos is None:
        raise CheckpointError(f"{folder}: weights an LW-DETR has no place for: {', '.join(unknown[:4]) or 'none'}; "
                              "or no position embeddings")
    sd["backbone.pos_embed"] = pos[:, 1:]  # the class token's slot: LW-DETR has no class token
    return sd


def transformers_lw_detr(folder: str | os.PathLike) -> DetectorFile:
    """A folder that transformers' ``LwDetrForObjectDetection.save_pretrained`` wrote: LW-DETR's own ViT (no class
    token, windows of the image in some blocks, layer scale, keys without bias), the multi-scale projector with
    batch norms, the two-stage heads of every query group and the decoder (``vitkit.models.rf_detr`` with
    ``window_blocks``)."""
    folder = Path(folder)
    config = read_config(folder)
    vit = config.get("backbone_config") or {}
    if vit.get("model_type") != "lw_detr_vit":
        raise CheckpointError(f"{folder}: an LW-DETR on a {vit.get('model_type')!r} backbone; vitkit reads its own "
                              "ViT (lw_detr_vit)")
    _refuse(folder, config, {"activation_function": "silu", "decoder_activation_function": "relu",
                             "attention_bias": True})
    _refuse(folder, vit, {"use_absolute_position_embeddings": True, "hidden_act": "gelu"})
    sd = _lw_detr_weights(folder, _weights(folder))
    pretrain = vit.get("pretrain_image_size", 224)
    preset, overrides = preset_for({**vit, "model_type": "vit", "image_size": pretrain,
                                    "intermediate_size": int(vit["hidden_size"] * vit.get("mlp_ratio", 4))})
    overrides.update(img_size=pretrain, class_token=False, no_embed_class=True, global_pool="",
                     qkv_bias="qv" if vit.get("qkv_bias", True) else False, init_values=1.0,
                     norm_eps=float(vit.get("layer_norm_eps", 1e-6)), pos_antialias=False, **IMAGENET)
    from vitkit.models.rf_detr import RFDETRConfig

    windows = int(round(vit.get("num_windows", 16) ** 0.5))
    cfg = RFDETRConfig(
        out_indices=tuple(int(i) for i in vit.get("out_indices") or [vit.get("num_hidden_layers", 12)]),
        windows=windows, window_blocks=tuple(int(i) for i in vit.get("window_block_indices") or ()),
        scales=tuple(float(f) for f in config.get("projector_scale_factors") or ()), projector_norm="batch",
        d_model=config.get("d_model", 256), hidden_expansion=float(config.get("hidden_expansion", 0.5)),
        c2f_blocks=config.get("c2f_num_blocks", 3), projector_eps=float(config.get("batch_norm_eps", 1e-5)),
        decoder_layers=config.get("decoder_layers", 3), self_heads=config.get("decoder_self_attention_heads", 8),
        cross_heads=config.get("decoder_cross_attention_heads", 16), points=config.get("decoder_n_points", 4),
        ffn_dim=config.get("decoder_ffn_dim", 2048), queries=config.get("num_queries", 300),
        groups=config.get("group_detr", 13), dropout=float(config.get("dropout", 0.0)))
    labels = config.get("id2label") or {}
    names = [labels[k] for k in sorted(labels, key=int)] if labels else []
    settings = dict(num_classes=sd["class_head.weight"].shape[0], cfg=cfg)
    return DetectorFile(preset, overrides, "rf_detr", settings, sd, names, unused=("backbone.norm.",))


def read_detector(path: str | os.PathLike) -> DetectorFile:
    """A detector's file in vitkit's names: a transformers YOLOS or RF-DETR folder, or RF-DETR's own ``.pth``."""
    path = Path(path)
    if not path.exists():
        raise MissingFileError(f"{path} is not there: vitkit.load_detector reads a local folder (what "
                               "save_pretrained wrote, or a model's snapshot folder in the Hugging Face cache)")
    if path.is_file() and path.suffix in (".pth", ".pt"):
        raw = read_file(path)
        if "args" in raw and "model" in raw:
            return interpreted(path, lambda: rf_detr_checkpoint(path, raw))
    if not (path / "config.json").is_file():
        own = ("; a vitkit run's checkpoint loads with "
               "vitkit.lit.Detector.load_from_checkpoint(path).eval().evaluated()") if path.suffix == ".ckpt" else ""
        raise CheckpointError(f"{path} is not a detector vitkit reads: expected a folder of transformers' "
                              "YolosForObjectDetection, RfDetrForObjectDetection or LwDetrForObjectDetection "
                              f"(config.json and model.safetensors) or an RF-DETR .pth (model and args){own}")
    kind = read_config(path).get("model_type")
    readers = {"rf_detr": transformers_rf_detr, "yolos": transformers_yolos, "lw_detr": transformers_lw_detr}
    if kind in readers:
        return interpreted(path, lambda: readers[kind](path))
    raise CheckpointError(f"{path}/config.json has model_type={kind!r}; vitkit reads detectors of model_type "
                          "'yolos', 'rf_detr' and 'lw_detr'")
