"""``vitkit convert``: any format vitkit reads -> a vitkit/timm folder, a timm state dict (.safetensors / .pth /
.bin), or, for a LoRA run's checkpoint, peft's adapter folder; a training checkpoint of the flat arguments of before
the modules' parts -> the same checkpoint with its settings as the parts (``OLD.ckpt NEW.ckpt``)."""

from __future__ import annotations

from pathlib import Path

from vitkit.errors import UsageError

from .common import OVERRIDES, command_parser, parse_overrides


def parser():
    p = command_parser("convert")
    p.add_argument("src", help="any format vitkit reads, a sharded (FSDP2) checkpoint folder included")
    p.add_argument("dst", nargs="?", help="a folder (model.safetensors + config.json), or a .safetensors / .pth / "
                   ".bin file; or NEW.ckpt: a training checkpoint written before the modules' parts, upgraded to them")
    p.add_argument("-o", "--output", help="the destination, as DST")
    p.add_argument("--model", help="preset name, for formats that do not record it")
    p.add_argument("--overrides", default="{}", help=OVERRIDES)
    p.add_argument("--adapter", action="store_true", help="a LoRA run's checkpoint -> peft's adapter folder "
                   "(adapter_config.json, adapter_model.safetensors), not merged into the backbone")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    import torch

    import vitkit
    from vitkit.checkpoints.files import atomic_write, write_safetensors

    if (args.dst is None) == (args.output is None):
        raise UsageError("give the destination once: `vitkit convert SRC DST` or `vitkit convert SRC -o DST`")
    args.dst = args.dst or args.output
    if args.adapter:
        return _adapter(args.src, Path(args.dst))
    if Path(args.dst).suffix == ".ckpt":
        return _upgrade(args.src, Path(args.dst))
    net = vitkit.create_model(args.model, checkpoint=args.src, **parse_overrides(args.overrides))
    dst = Path(args.dst)
    if dst.suffix == ".safetensors":
        write_safetensors(net.state_dict(), dst, metadata={"format": "pt"})
    elif dst.suffix in (".pth", ".pt", ".bin"):
        atomic_write(dst, lambda tmp: torch.save(net.state_dict(), tmp))
    elif dst.suffix == "":
        vitkit.save_pretrained(net, dst, class_names=getattr(net, "class_names", None))
    else:
        raise UsageError(f"unknown destination {args.dst!r}: expected a folder, .safetensors, .pth, .pt or .bin")
    print(f"{args.src} ({net.load_report.format}) -> {dst} as {net.name} in timm / vitkit names")
    return 0


def _adapter(src: str, dst: Path) -> int:
    """A LoRA run's Lightning checkpoint -> peft's adapter folder, the classifier among the modules it saves."""
    import torch

    import vitkit
    from vitkit.checkpoints.adapt import classifier_names
    from vitkit.checkpoints.adapters import adapted_model, run_settings, save_adapter

    raw = torch.load(src, map_location="cpu", weights_only=True) if Path(src).is_file() else {}
    hp = raw.get("hyper_parameters") or {} if isinstance(raw, dict) else {}
    if run_settings(hp) is None:
        raise UsageError(f"--adapter takes the checkpoint of a LoRA run (--model.adaptation LoRA); {src} is not "
                         "one")
    trained = {k[len("model."):]: v for k, v in raw["state_dict"].items() if k.startswith("model.")}
    model = adapted_model(hp, trained, Path(src), vitkit.create_model)
    heads = classifier_names(model)
    save_adapter(model, dst, base_model=hp.get("checkpoint") or hp["model_name"],
                 head=[heads] if isinstance(heads, str) else list(heads))
    print(f"{src} -> {dst}: peft adapter folder for {model.name} ({len(trained)} tensors; base model: "
          f"{hp.get('checkpoint') or hp['model_name']})")
    return 0


def _upgrade(src: str, dst: Path) -> int:
    """A training checkpoint of a module's flat arguments (written before its parts) -> the same checkpoint with them
    as the parts (``Flat.to_parts``): weights, optimizer and loop state as they were, so that it loads, resumes and
    runs every command as one written today."""
    import torch

    from vitkit.checkpoints.files import atomic_write
    from vitkit.training.flat import flat_of

    if not Path(src).is_file() or Path(src).suffix != ".ckpt":
        raise UsageError(f"a .ckpt destination upgrades a training checkpoint (.ckpt); {src} is not one")
    raw = torch.load(src, map_location="cpu", weights_only=True)
    hp = raw.get("hyper_parameters") if isinstance(raw, dict) else None
    flat = flat_of((hp or {}).get("_class_path"))
    if not isinstance(hp, dict) or flat is None:
        raise UsageError(f"{src} is not the training checkpoint of a vitkit module (its hyper-parameters name none)")
    if not flat.is_flat(hp):
        raise UsageError(f"{src} holds its settings as the module's parts already; nothing to upgrade")
    raw["hyper_parameters"] = flat.to_parts(hp)
    atomic_write(dst, lambda tmp: torch.save(raw, tmp))
    old = sum(1 for k in hp if flat.takes_flag(k))
    print(f"{src} -> {dst}: {hp['_class_path']}'s {old} flat settings as its parts "
          f"({', '.join(p for p in flat.parts if p in raw['hyper_parameters'])})")
    return 0
