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

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import Tensor, nn

from vitkit.errors import MissingPackageError, UsageError

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
            raise UsageError(f"lora_rank must be an integer >= 0 (0: no adapters), got {self.rank!r}")
        if self.alpha is not None and not self.alpha > 0:
            raise UsageError(f"lora_alpha must be > 0 (or null: the rank), got {self.alpha!r}")
        if not 0 <= self.dropout < 1:
            raise UsageError(f"lora_dropout must be in [0, 1), got {self.dropout!r}")
        if isinstance(self.targets, str):
            self.targets = [self.targets]
        if not self.targets or not all(isinstance(t, str) and t for t in self.targets):
            raise UsageError(f"lora_targets must be a list of module names such as {list(DEFAULT_TARGETS)}, got "
                             f"{self.targets!r}")
        self.targets = list(self.targets)
        if not self.parts or set(self.parts) - set("qkv") or len(set(self.parts)) != len(self.parts):
            raise UsageError(f"lora_parts must name some of q, k and v once each (qkv, qv, q, ...), got "
                             f"{self.parts!r}")


DEFAULTS = LoraSettings()
DEFAULTS_OF = {f.name: getattr(DEFAULTS, f.name) for f in fields(LoraSettings)}


def _peft():
    try:
        import peft
    except ImportError as e:
        raise MissingPackageError(f"LoRA needs Hugging Face's peft ({e}): pip install 'vitkit[lora]'") from None
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
        raise UsageError(f"lora_targets {settings.targets} match no linear layer of "
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

def _row_sizes(model: nn.Module, name: str) -> dict[str, int]:
    attn = model.get_submodule(name.rpartition(".")[0])
    return {"q": attn.num_heads * attn.head_dim, "k": attn.num_kv_heads * attn.head_dim,
            "v": attn.num_kv_heads * attn.head_dim}



def check_adaptation(lora: LoraSettings, freeze_backbone: bool, lr_scale: float) -> None:
    """A training module's LoRA arguments beside its others: adapters need a backbone that trains, and a positive
    LR scale for them."""
    if lora.rank and freeze_backbone:
        raise UsageError("lora_rank with freeze_backbone: LoRA trains adapters in the backbone; give one")
    if lora.rank and not lr_scale > 0:
        raise UsageError(f"lora_lr_scale must be > 0 (the adapters' LR over lr), got {lr_scale!r}")


def settings_of(hp: Mapping[str, Any]) -> LoraSettings:
    """The settings a run's ``lora_*`` hyper-parameters give (a module's, or a checkpoint's); what they leave out or
    leave null keeps :data:`DEFAULTS`, the one place LoRA's defaults stand."""
    return LoraSettings(*(DEFAULTS_OF[f] if hp.get(f"lora_{f}") is None else hp[f"lora_{f}"] for f in DEFAULTS_OF))
