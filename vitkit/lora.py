"""Low-rank adapters (LoRA, Hu et al., 2022) on any vitkit model, through Hugging Face's peft.

peft injects its LoRA layers into the model in place (``peft.inject_adapter_in_model``): a target such as
``blocks.0.attn.qkv`` keeps its name, holds the original layer as ``base_layer`` and gains ``lora_A`` and
``lora_B``; every other module, the layer-decay groups and the sharding see the same tree. Targets are timm's
module names, matched as peft matches them: the whole name, or its ending after a dot (``attn.qkv``).

The attention's input projection is one fused ``qkv`` layer (timm's layout, rows [q | k | v]). ``parts="qv"``
adapts the query and value rows alone, as LoRA's paper does: the key rows of ``lora_B`` start at zero and its
output there is masked, so they get no gradient and stay zero; the adapter is still one peft LoRA layer on
``qkv``, which peft and timm read as they are.

Merging adds ``lora_B @ lora_A * alpha / rank`` to each base weight and puts the plain layer back: the model is
the preset's again, with timm's names, and needs no peft.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

DEFAULT_TARGETS = ("attn.qkv", "attn.proj")  # the attention's input and output projections
ADAPTER = "default"  # peft's adapter name


@dataclass
class LoraSettings:
    """What a LoRA run adapts: ``rank`` (0: no adapters), ``alpha`` (the update is scaled by alpha / rank; None:
    alpha = rank), ``dropout`` on the adapters' input, ``targets`` (timm module names or their endings) and
    ``parts`` (which of a fused qkv projection's q, k and v are adapted)."""

    rank: int = 0
    alpha: float | None = None
    dropout: float = 0.0
    targets: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    parts: str = "qkv"

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"lora_rank must be an integer >= 0 (0: no adapters), got {self.rank!r}")
        if self.alpha is not None and not self.alpha > 0:
            raise ValueError(f"lora_alpha must be > 0 (or null: the rank), got {self.alpha!r}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"lora_dropout must be in [0, 1), got {self.dropout!r}")
        if isinstance(self.targets, str):
            self.targets = [self.targets]
        if not self.targets or not all(isinstance(t, str) and t for t in self.targets):
            raise ValueError(f"lora_targets must be a list of module names such as {list(DEFAULT_TARGETS)}, got "
                             f"{self.targets!r}")
        self.targets = list(self.targets)
        if not self.parts or set(self.parts) - set("qkv") or len(set(self.parts)) != len(self.parts):
            raise ValueError(f"lora_parts must name some of q, k and v once each (qkv, qv, q, ...), got "
                             f"{self.parts!r}")


DEFAULTS = LoraSettings()
DEFAULTS_OF = {f.name: getattr(DEFAULTS, f.name) for f in fields(LoraSettings)}


def _peft():
    try:
        import peft
    except ImportError as e:
        raise ImportError(f"LoRA needs Hugging Face's peft ({e}): pip install 'vitkit[lora]'") from None
    return peft


def matches(name: str, targets: list[str]) -> bool:
    """peft's rule for a list of targets: the whole name, or its ending after a dot."""
    return any(name == t or name.endswith("." + t) for t in targets)


def linear_layers(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def _endings(names: list[str]) -> list[str]:
    """The distinct module-name endings (``attn.qkv``, ``mlp.fc1``, ``head``) of ``names``, in order."""
    out: list[str] = []
    for n in names:
        parts = [p for p in n.split(".") if not p.isdigit()]
        end = ".".join(parts[-2:]) if len(parts) > 1 and parts[-2] not in ("layers", "blocks") else parts[-1]
        if end not in out:
            out.append(end)
    return out


def add_lora(model: nn.Module, settings: LoraSettings) -> list[str]:
    """Inject LoRA layers into ``model`` in place and freeze everything else; returns the adapted layers' names.
    The classifier stays as it was (the caller decides whether it trains)."""
    peft = _peft()
    linear = linear_layers(model)
    names = [n for n in linear if matches(n, settings.targets)]
    if not names:
        raise ValueError(f"lora_targets {settings.targets} match no linear layer of "
                         f"{getattr(model, 'name', 'the model')}; its linear layers are named like: "
                         f"{', '.join(_endings(linear))}")
    config = peft.LoraConfig(r=settings.rank, lora_alpha=settings.alpha or settings.rank,
                             lora_dropout=settings.dropout, target_modules=names, bias="none")
    for p in model.parameters():
        p.requires_grad_(False)
    peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    if settings.parts != "qkv":
        for name in names:
            if name.endswith("qkv"):
                _keep_parts(model, name, settings.parts)
    model.lora = settings  # what convert, export and the checkpoint read
    return names


def _row_mask(model: nn.Module, name: str, parts: str) -> Tensor:
    """1 on the rows of the fused projection ``name`` that belong to ``parts``, 0 elsewhere."""
    return torch.cat([torch.full((n,), float(p in parts)) for p, n in _row_sizes(model, name).items()])


def _keep_parts(model: nn.Module, name: str, parts: str) -> None:
    lora_b = model.get_submodule(name).lora_B[ADAPTER]
    lora_b.rows = mask = _row_mask(model, name, parts)  # not a buffer: the state dict keeps peft's keys
    _zero_other_rows(lora_b)
    lora_b.register_forward_hook(lambda m, args, out: out * mask.to(out))  # no gradient reaches the other rows


@torch.no_grad()
def _zero_other_rows(lora_b: nn.Module) -> None:
    """The rows of the parts not adapted at zero (as training keeps them), before a merge or a save."""
    rows = getattr(lora_b, "rows", None)
    if rows is not None:
        lora_b.weight.mul_(rows.to(lora_b.weight)[:, None])


def lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    peft = _peft()
    return [(n, m) for n, m in model.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)]


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base layer and put the plain layer back, in place."""
    for name, layer in lora_layers(model):
        _zero_other_rows(layer.lora_B[ADAPTER])
        layer.merge(safe_merge=True)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer.get_base_layer())
    if "lora" in vars(model):
        del model.lora
    return model


def is_adapter_key(key: str) -> bool:
    return ".lora_A." in key or ".lora_B." in key


# -- peft's adapter folder ------------------------------------------------------------------------------------

PEFT_PREFIX = "base_model.model."


def save_adapter(model: nn.Module, directory: str | Path, base_model: str, head: list[str]) -> Path:
    """Write peft's adapter folder for ``model`` (adapters injected by :func:`add_lora`): ``adapter_config.json``
    and ``adapter_model.safetensors``, the classifier ``head`` (module names) among the modules to save, as
    ``PeftModel.from_pretrained(timm_model, directory)`` reads it. The modules are timm's: where timm's Eva class
    splits what vitkit fuses, an adapter on the fused ``attn.qkv`` becomes one per ``q_proj``, ``k_proj``,
    ``v_proj`` (the same ``lora_A``, ``lora_B``'s rows of each), and adapters on ``mlp.fc1_g`` and ``mlp.fc1_x``
    one of twice the rank on the packed ``mlp.fc1`` (``lora_B`` block-diagonal): the same update exactly."""
    from vitkit.checkpoints.files import write_json, write_safetensors
    from vitkit.checkpoints.load import timm_args, timm_shapes

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
        raise ValueError(f"{name}: timm's {model.name} computes its qkv from qkv.weight directly (with its q and v "
                         "biases), so peft's adapter on it would be ignored there; convert without --adapter to merge "
                         "it, or train with --model.lora_targets that leave attn.qkv out")
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
    raise ValueError(f"{name}: timm's {getattr(model, 'name', 'model')} has no such layer to put its adapter on")


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
        raise FileNotFoundError(f"{directory} is not a peft adapter folder: it has no adapter_config.json")
    try:
        config = json.loads(config_file.read_text())
        kind, rank, targets = config.get("peft_type"), config["r"], config["target_modules"]
    except (ValueError, KeyError, AttributeError) as e:
        raise ValueError(f"{config_file} is not a peft adapter config with r and target_modules "
                         f"({type(e).__name__}: {e})") from None
    if kind != "LORA":
        raise ValueError(f"{config_file}: a {kind} adapter; vitkit reads LoRA adapters")
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
            raise ValueError(f"{weights} does not fit {getattr(model, 'name', 'the model')}: it has {key}, which the "
                             "model has not (an adapter for another model?)")
        if own[key].shape != value.shape:
            raise ValueError(f"{weights} does not fit {getattr(model, 'name', 'the model')} ({key}: adapter "
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
                raise ValueError(f"{source}: the adapters of {m[1]}'s q_proj, k_proj and v_proj have different "
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
                raise ValueError(f"{source}: the adapter of {stem} mixes the gate's and the value's rows; vitkit's "
                                 "fc1_g and fc1_x take one each (load this folder onto timm's model with peft)")
            out.update({f"{stem}_g.lora_A.weight": a[:r], f"{stem}_g.lora_B.weight": b[:h, :r],
                        f"{stem}_x.lora_A.weight": a[r:], f"{stem}_x.lora_B.weight": b[h:, r:]})
        else:
            out[key] = value
    return out, parts


def _row_sizes(model: nn.Module, name: str) -> dict[str, int]:
    attn = model.get_submodule(name.rpartition(".")[0])
    return {"q": attn.num_heads * attn.head_dim, "k": attn.num_kv_heads * attn.head_dim,
            "v": attn.num_kv_heads * attn.head_dim}


# -- a LoRA run's Lightning checkpoint ----------------------------------------------------------------------------


def check_adaptation(lora: LoraSettings, freeze_backbone: bool, lr_scale: float) -> None:
    """A training module's LoRA arguments beside its others: adapters need a backbone that trains, and a positive
    LR scale for them."""
    if lora.rank and freeze_backbone:
        raise ValueError("lora_rank with freeze_backbone: LoRA trains adapters in the backbone; give one")
    if lora.rank and not lr_scale > 0:
        raise ValueError(f"lora_lr_scale must be > 0 (the adapters' LR over lr), got {lr_scale!r}")


def settings_of(hp: Mapping[str, Any]) -> LoraSettings:
    """The settings a run's ``lora_*`` hyper-parameters give (a module's, or a checkpoint's); what they leave out or
    leave null keeps :data:`DEFAULTS`, the one place LoRA's defaults stand."""
    return LoraSettings(*(DEFAULTS_OF[f] if hp.get(f"lora_{f}") is None else hp[f"lora_{f}"] for f in DEFAULTS_OF))


def run_settings(hp: Mapping[str, Any]) -> LoraSettings | None:
    """The adapters of a run's hyper-parameters (a module's, or a checkpoint's): a classifier's ``adaptation`` part of
    kind LoRA, or the flat ``lora_*`` arguments (a segmenter's, a classifier's before its parts); None without."""
    from vitkit.checkpoints.load import lora_arguments

    given = lora_arguments(dict(hp))
    return None if given is None else settings_of(given)


def require_backbone(hp: Mapping[str, Any], source: Any) -> str | None:
    """The backbone file a checkpoint of what trained names (``checkpoint`` in its hyper-parameters; None for a
    checkpoint of every weight), refused in one line where it is no longer there."""
    backbone = hp.get("checkpoint")
    if isinstance(backbone, str) and not Path(os.path.expanduser(backbone)).exists():
        raise FileNotFoundError(f"{source} holds LoRA adapters for the backbone {backbone}, which is not there; "
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
        raise ValueError(f"{source}: its adapters do not fit the model {model.name} built from its backbone "
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
