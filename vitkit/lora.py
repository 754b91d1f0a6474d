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
from dataclasses import dataclass, field
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
    attn = model.get_submodule(name.rpartition(".")[0])
    H, Hkv, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
    sizes = {"q": H * D, "k": Hkv * D, "v": Hkv * D}
    return torch.cat([torch.full((n,), float(p in parts)) for p, n in sizes.items()])


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
    ``PeftModel.from_pretrained(timm_model, directory)`` reads it."""
    from vitkit.checkpoints.files import write_json, write_safetensors

    peft = _peft()
    settings: LoraSettings = model.lora
    names = [n for n, _ in lora_layers(model)]
    for _, layer in lora_layers(model):
        _zero_other_rows(layer.lora_B[ADAPTER])
    config = peft.LoraConfig(r=settings.rank, lora_alpha=settings.alpha or settings.rank,
                             lora_dropout=settings.dropout, target_modules=names, bias="none",
                             modules_to_save=head, base_model_name_or_path=base_model)
    state = {}
    for key, value in model.state_dict().items():
        if is_adapter_key(key):  # peft stores an adapter without its name
            state[PEFT_PREFIX + key.replace(f".{ADAPTER}.", ".")] = value
        elif any(key.startswith(h + ".") for h in head):
            state[PEFT_PREFIX + key] = value
    directory = Path(directory)
    write_json(_json_ready(config.to_dict()), directory / "adapter_config.json")
    write_safetensors({k: v.detach().contiguous() for k, v in state.items()}, directory / "adapter_model.safetensors",
                      metadata={"format": "pt"})
    return directory


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
    settings = LoraSettings(rank=rank, alpha=config.get("lora_alpha"), dropout=config.get("lora_dropout", 0.0),
                            targets=[targets] if isinstance(targets, str) else list(targets))
    names = add_lora(model, settings)
    weights = directory / "adapter_model.safetensors"
    state = {}
    for key, value in load_file(weights).items():
        key = key.removeprefix(PEFT_PREFIX)
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


# -- a LoRA run's Lightning checkpoint ----------------------------------------------------------------------------


def settings_of(hp: dict) -> LoraSettings:
    return LoraSettings(hp["lora_rank"], hp.get("lora_alpha"), hp.get("lora_dropout", 0.0),
                        hp.get("lora_targets") or list(DEFAULT_TARGETS), hp.get("lora_parts", "qkv"))


def adapted_model(hp: dict, trained: dict[str, Tensor], source: Path, build) -> nn.Module:
    """The model of a LoRA run's checkpoint, adapters not merged: the backbone its hyper-parameters name, built by
    ``build`` (``vitkit.create_model``) as the run built it, the adapters injected and the trained tensors (adapters,
    head) loaded."""
    backbone = hp.get("checkpoint")
    if backbone and not Path(backbone).exists():
        raise FileNotFoundError(f"{source} holds LoRA adapters for the backbone {backbone}, which is not there; "
                                "put it back at that path (the checkpoint names it)")
    overrides = dict(hp.get("model_overrides") or {})
    overrides.update({k: hp[k] for k in ("num_classes", "img_size") if hp.get(k) is not None})
    model = build(hp["model_name"], pretrained=bool(hp.get("pretrained")), checkpoint=backbone, **overrides)
    add_lora(model, settings_of(hp))
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
