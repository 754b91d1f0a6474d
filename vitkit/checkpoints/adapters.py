"""LoRA adapters as files: peft's adapter folder in timm's module names (``save_adapter``, ``load_adapter``), and
a LoRA run's Lightning checkpoint read back as a model (the backbone it names, the adapters on it, merged or not).
The adapters themselves are in ``vitkit/models/lora.py``."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from vitkit.errors import MissingFileError, UsageError

from ..models.lora import (  # noqa: F401
    ADAPTER,
    DEFAULT_TARGETS,
    DEFAULTS,
    LoraSettings,
    _peft,
    _row_sizes,
    _zero_other_rows,
    add_lora,
    check_adaptation,
    is_adapter_key,
    lora_layers,
    merge_lora,
    settings_of,
)
from .files import write_json, write_safetensors
from .load import lora_arguments, timm_args, timm_shapes

# -- peft's adapter folder ------------------------------------------------------------------------------------

PEFT_PREFIX = "base_model.model."


def save_adapter(model: nn.Module, directory: str | Path, base_model: str, head: list[str]) -> Path:
    """Write peft's adapter folder for ``model`` (adapters injected by :func:`add_lora`): ``adapter_config.json``
    and ``adapter_model.safetensors``, the classifier ``head`` (module names) among the modules to save, as
    ``PeftModel.from_pretrained(timm_model, directory)`` reads it. The modules are timm's: where timm's Eva class
    splits what vitkit fuses, an adapter on the fused ``attn.qkv`` becomes one per ``q_proj``, ``k_proj``,
    ``v_proj`` (the same ``lora_A``, ``lora_B``'s rows of each), and adapters on ``mlp.fc1_g`` and ``mlp.fc1_x``
    one of twice the rank on the packed ``mlp.fc1`` (``lora_B`` block-diagonal): the same update exactly."""

    peft = _peft()
    settings: LoraSettings = model.lora
    theirs = timm_shapes(*timm_args(model)) or {}
    alpha = settings.alpha or settings.rank
    adapters, ranks = {}, {}
    for name, layer in lora_layers(model):
        _zero_other_rows(layer.lora_B[ADAPTER])
        a, b = layer.lora_A[ADAPTER].weight.detach(), layer.lora_B[ADAPTER].weight.detach()
        for target, ta, tb in _timm_adapters(model, name, a, b, theirs, adapters):
            adapters[target] = (ta, tb)
            if ta.shape[0] != settings.rank:
                ranks[target] = ta.shape[0]
    config = peft.LoraConfig(r=settings.rank, lora_alpha=alpha, lora_dropout=settings.dropout,
                             target_modules=list(adapters), bias="none", modules_to_save=head,
                             rank_pattern=ranks, alpha_pattern={k: alpha * r / settings.rank for k, r in ranks.items()},
                             base_model_name_or_path=base_model)
    state = {}
    for target, (a, b) in adapters.items():  # peft stores an adapter without its name
        state[f"{PEFT_PREFIX}{target}.lora_A.weight"], state[f"{PEFT_PREFIX}{target}.lora_B.weight"] = a, b
    for key, value in model.state_dict().items():
        if any(key.startswith(h + ".") for h in head):
            state[PEFT_PREFIX + key] = value
    directory = Path(directory)
    write_json(_json_ready(config.to_dict()), directory / "adapter_config.json")
    write_safetensors({k: v.detach().contiguous() for k, v in state.items()}, directory / "adapter_model.safetensors",
                      metadata={"format": "pt"})
    return directory


def _timm_adapters(model: nn.Module, name: str, a: Tensor, b: Tensor, theirs: dict, done: dict):
    """(timm's module name, lora_A, lora_B) for vitkit's adapter on ``name``: the same where timm has the module
    (or where timm has no such model: ``theirs`` empty)."""
    stem, _, leaf = name.rpartition(".")
    if leaf == "qkv" and f"{stem}.q_bias" in theirs:
        raise UsageError(f"{name}: timm's {model.name} computes its qkv from qkv.weight directly (with its q and v "
                         "biases), so peft's adapter on it would be ignored there; convert without --adapter to merge "
                         "it, or train with --model.adaptation.targets that leave attn.qkv out")
    if not theirs or f"{name}.weight" in theirs:
        return [(name, a, b)]
    if leaf == "qkv" and f"{stem}.q_proj.weight" in theirs:
        parts = getattr(model.lora, "parts", "qkv")
        sizes = [theirs[f"{stem}.{p}_proj.weight"][0] for p in "qkv"]
        return [(f"{stem}.{p}_proj", a.clone(), rows) for p, rows in zip("qkv", b.split(sizes), strict=True)
                if p in parts]
    if leaf in ("fc1_g", "fc1_x") and f"{stem}.fc1.weight" in theirs:
        if f"{stem}.fc1" in done:
            return []
        pair = {}
        for half in ("fc1_g", "fc1_x"):
            layer = model.get_submodule(f"{stem}.{half}")
            if hasattr(layer, "lora_A"):
                pair[half] = layer.lora_A[ADAPTER].weight.detach(), layer.lora_B[ADAPTER].weight.detach()
            else:  # one half adapted: the other's update is zero
                pair[half] = a.new_zeros(a.shape[0], layer.in_features), b.new_zeros(layer.out_features, b.shape[1])
        (ag, bg), (ax, bx) = pair["fc1_g"], pair["fc1_x"]
        return [(f"{stem}.fc1", torch.cat([ag, ax]), torch.block_diag(bg, bx))]
    raise UsageError(f"{name}: timm's {getattr(model, 'name', 'model')} has no such layer to put its adapter on")


def _json_ready(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _json_ready(v) for k, v in value.items()}
    if isinstance(value, (set, tuple, list)):
        return [_json_ready(v) for v in (sorted(value) if isinstance(value, set) else value)]
    return getattr(value, "value", value)  # peft's enums


def load_adapter(model: nn.Module, directory: str | Path) -> list[str]:
    """Read peft's adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) into ``model``: its
    adapters are injected as :func:`add_lora` does and loaded with the modules it saves; a folder made for another
    model ends in one line naming the first tensor whose shape differs."""
    from safetensors.torch import load_file

    directory = Path(directory)
    config_file = directory / "adapter_config.json"
    if not config_file.is_file():
        raise MissingFileError(f"{directory} is not a peft adapter folder: it has no adapter_config.json")
    try:
        config = json.loads(config_file.read_text())
        kind, rank, targets = config.get("peft_type"), config["r"], config["target_modules"]
    except (ValueError, KeyError, AttributeError) as e:
        raise UsageError(f"{config_file} is not a peft adapter config with r and target_modules "
                         f"({type(e).__name__}: {e})") from None
    if kind != "LORA":
        raise UsageError(f"{config_file}: a {kind} adapter; vitkit reads LoRA adapters")
    weights = directory / "adapter_model.safetensors"
    saved = {key.removeprefix(PEFT_PREFIX): value for key, value in load_file(weights).items()}
    saved, parts = _vitkit_adapters(model, saved, weights)
    targets = sorted({k.rpartition(".lora_")[0] for k in saved if is_adapter_key(k)}) or \
        ([targets] if isinstance(targets, str) else list(targets))
    settings = LoraSettings(rank=rank, alpha=config.get("lora_alpha"), dropout=config.get("lora_dropout", 0.0),
                            targets=targets, parts=parts)
    names = add_lora(model, settings)
    state = {}
    for key, value in saved.items():
        for part in (".lora_A.", ".lora_B."):
            key = key.replace(part, f"{part}{ADAPTER}.") if part in key else key
        state[key] = value
    own = model.state_dict()
    for key, value in state.items():
        if key not in own:
            raise UsageError(f"{weights} does not fit {getattr(model, 'name', 'the model')}: it has {key}, which the "
                             "model has not (an adapter for another model?)")
        if own[key].shape != value.shape:
            raise UsageError(f"{weights} does not fit {getattr(model, 'name', 'the model')} ({key}: adapter "
                             f"{tuple(value.shape)} vs model {tuple(own[key].shape)}); base model of the adapter: "
                             f"{config.get('base_model_name_or_path')}")
    model.load_state_dict(state, strict=False)
    return names


def _vitkit_adapters(model: nn.Module, saved: dict[str, Tensor], source: Path) -> tuple[dict[str, Tensor], str]:
    """An adapter folder's tensors in vitkit's layout (the inverse of :func:`_timm_adapters`) and the qkv parts
    it adapts: adapters on timm's separate ``q_proj``, ``k_proj``, ``v_proj`` (one ``lora_A``) become one on the
    fused ``qkv``, the packed ``mlp.fc1``'s block-diagonal one becomes ``mlp.fc1_g``'s and ``mlp.fc1_x``'s."""
    own = dict(model.named_modules())
    out, parts = {}, "qkv"
    for key, value in saved.items():
        stem, _, rest = key.partition(".lora_")
        m = re.match(r"(.*\.attn)\.([qkv])_proj$", stem)
        if m and stem not in own and f"{m[1]}.qkv" in own:
            qkv = f"{m[1]}.qkv"
            if f"{qkv}.lora_A.weight" in out:
                continue
            found = {p: (saved[f"{m[1]}.{p}_proj.lora_A.weight"], saved[f"{m[1]}.{p}_proj.lora_B.weight"])
                     for p in "qkv" if f"{m[1]}.{p}_proj.lora_A.weight" in saved}
            a = next(iter(found.values()))[0]
            if any(not torch.equal(fa, a) for fa, _ in found.values()):
                raise UsageError(f"{source}: the adapters of {m[1]}'s q_proj, k_proj and v_proj have different "
                                 "lora_A; vitkit's fused qkv takes one (load this folder onto timm's model with peft)")
            sizes = _row_sizes(model, qkv)
            out[f"{qkv}.lora_A.weight"] = a
            out[f"{qkv}.lora_B.weight"] = torch.cat([found[p][1] if p in found else a.new_zeros(n, a.shape[0])
                                                      for p, n in sizes.items()])
            parts = "".join(found)
        elif re.search(r"\.mlp\.fc1$", stem) and stem not in own and f"{stem}_g" in own:
            if rest != "A.weight":
                continue
            a, b = value, saved[f"{stem}.lora_B.weight"]
            r, h = a.shape[0] // 2, b.shape[0] // 2
            if b[:h, r:].any() or b[h:, :r].any():
                raise UsageError(f"{source}: the adapter of {stem} mixes the gate's and the value's rows; vitkit's "
                                 "fc1_g and fc1_x take one each (load this folder onto timm's model with peft)")
            out.update({f"{stem}_g.lora_A.weight": a[:r], f"{stem}_g.lora_B.weight": b[:h, :r],
                        f"{stem}_x.lora_A.weight": a[r:], f"{stem}_x.lora_B.weight": b[h:, r:]})
        else:
            out[key] = value
    return out, parts



# -- a LoRA run's Lightning checkpoint ----------------------------------------------------------------------------


def run_settings(hp: Mapping[str, Any]) -> LoraSettings | None:
    """The adapters of a run's hyper-parameters (a module's, or a checkpoint's): a classifier's ``adaptation`` part of
    kind LoRA, or the flat ``lora_*`` arguments (a segmenter's, a classifier's before its parts); None without."""

    given = lora_arguments(dict(hp))
    return None if given is None else settings_of(given)


def require_backbone(hp: Mapping[str, Any], source: Any) -> str | None:
    """The backbone file a checkpoint of what trained names (``checkpoint`` in its hyper-parameters; None for a
    checkpoint of every weight), refused in one line where it is no longer there."""
    backbone = hp.get("checkpoint")
    if isinstance(backbone, str) and not Path(os.path.expanduser(backbone)).exists():
        raise MissingFileError(f"{source} holds LoRA adapters for the backbone {backbone}, which is not there; "
                               "put it back at that path (the checkpoint names it)")
    return backbone


def adapted_model(hp: dict, trained: dict[str, Tensor], source: Path, build) -> nn.Module:
    """The model of a LoRA run's checkpoint, adapters not merged: the backbone its hyper-parameters name, built by
    ``build`` (``vitkit.create_model``) as the run built it, the adapters injected and the trained tensors (adapters,
    head) loaded."""
    backbone = require_backbone(hp, source)
    overrides = dict(hp.get("model_overrides") or {})
    overrides.update({k: hp[k] for k in ("num_classes", "img_size") if hp.get(k) is not None})
    model = build(hp["model_name"], pretrained=bool(hp.get("pretrained")), checkpoint=backbone, **overrides)
    add_lora(model, run_settings(hp))
    missing = [k for k in trained if k not in model.state_dict()]
    if missing:
        raise UsageError(f"{source}: its adapters do not fit the model {model.name} built from its backbone "
                         f"({missing[0]} is not in the model)")
    model.load_state_dict(trained, strict=False)
    return model


def merge_checkpoint(ck, build) -> None:
    """A LoRA run's checkpoint as ``read_checkpoint`` read it (``ck.lora`` set): its state dict becomes the whole
    model's, the adapters merged into the backbone they name."""
    import dataclasses

    model = merge_lora(adapted_model(ck.lora, ck.state_dict, ck.path, build))
    ck.state_dict, ck.lora = model.state_dict(), None
    ck.overrides = {**ck.overrides, **{k: v for k, v in dataclasses.asdict(model.cfg).items() if k != "num_classes"}}
