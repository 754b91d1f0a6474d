"""The ``vitkit`` command's subcommands, one function each (``predict``, ``export``, ``download``, ``models``,
``bench``, ``convert``, ``attention-map``, ``reconstruct``, ``pos-embed``, ``prepare-data``, ``recipes``): each takes
the parsed arguments and returns the exit status. The parser and the entry point are in ``vitkit/cli.py``.

Each command imports torch and the rest of vitkit itself, so that ``vitkit --help`` and ``vitkit recipes`` answer
at once, without importing torch."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def _overrides(text: str) -> dict:
    """``--overrides``: a JSON object of config fields (their types are checked when the model is built)."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise SystemExit(f"error: --overrides expects a JSON object such as '{{\"depth\": 6}}', got {text!r} "
                         f"({e})") from None
    if not isinstance(value, dict):
        raise SystemExit(f"error: --overrides expects a JSON object such as '{{\"depth\": 6}}', got a JSON "
                         f"{type(value).__name__}: {text!r}")
    return value


def _load(args: argparse.Namespace) -> torch.nn.Module:
    import vitkit
    from vitkit.checkpoints.hub import MissingWeightsError

    if args.checkpoint is None and args.model is None:
        raise SystemExit("error: give --checkpoint FILE, or --model NAME for pretrained weights by name "
                         "(a timm tag such as vit_base_patch16_224.augreg2_in21k_ft_in1k, or torchvision weights)")
    overrides = _overrides(args.overrides)
    if getattr(args, "token_merging", None):
        overrides["token_merging"] = args.token_merging
    try:
        net = vitkit.create_model(args.model, checkpoint=args.checkpoint, pretrained=args.checkpoint is None,
                                  **overrides).eval()
    except MissingWeightsError as e:
        raise SystemExit(f"error: {e}") from None
    except ValueError as e:
        if "token_merging" not in overrides:
            raise
        raise SystemExit(f"error: --token-merging {args.token_merging}: {e}") from None
    if vitkit.family(net.name) == "seq2seq":
        raise SystemExit(f"error: {args.checkpoint} holds an encoder-decoder ({net.name}); this command takes "
                         "classifiers")
    _require_classifier(net, args.checkpoint or args.model)
    return net


def _require_classifier(net: torch.nn.Module, source: str) -> None:
    """Refuse a backbone: a model without a classifier, or with one that the weights did not hold."""
    report = getattr(net, "load_report", None)
    if net.cfg.num_classes == 0 or (report is not None and report.new_head):
        what = "has no classifier head (num_classes=0)" if net.cfg.num_classes == 0 else (
            f"holds no classifier for the {net.cfg.num_classes} classes asked for (new, untrained: "
            f"{', '.join(report.new_head)})")
        raise SystemExit(f"error: {source} {what}: it is a backbone, so there are no classes to predict. Fine-tune "
                         "it first, e.g. `vitkit train fit -c vit_base_finetune --model.model_name "
                         f"{net.name} --model.pretrained false --model.checkpoint {source} --data.root DATA`, then "
                         "use the checkpoint that writes")


def _refuse_an_embedding(net: torch.nn.Module, tag: str | None, checkpoint: str | None = None) -> None:
    """CLIP's image towers (by tag, or from an OpenAI / OpenCLIP / transformers CLIP file) end in CLIP's projection
    into the image-text space: those outputs are an embedding, not classes (the fine-tuned tags, ``*_ft_in1k``,
    have a classifier and label names)."""
    from vitkit.checkpoints.formats import FORMATS

    report = getattr(net, "load_report", None)
    by_tag = tag and "_clip_" in net.name and "." in tag and "_ft_" not in tag
    by_file = checkpoint and report is not None and report.format in FORMATS and FORMATS[report.format].embedding_head
    if not (by_tag or by_file) or getattr(net, "class_names", None):
        return
    import timm

    tuned = timm.list_pretrained(f"{net.name}.*_ft_*") if by_tag else []
    source = f"--model.model_name {tag}" if by_tag else \
        f"--model.model_name {net.name} --model.pretrained false --model.checkpoint {checkpoint}"
    what = tag if by_tag else f"{checkpoint} ({report.format})"
    raise SystemExit(f"error: {what} is CLIP's image tower: its {net.cfg.num_classes} outputs are its image "
                     "embedding (the projection into CLIP's image-text space), not classes. "
                     + (f"Take a fine-tuned tag ({', '.join(tuned)}), or fine-tune" if tuned else "Fine-tune")
                     + f" it: `vitkit train fit -c vit_base_clip_finetune {source} "
                     "--data.root DATA`")


def _image(path: str, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """(model input (1, C, H, W) after the model's eval transform, the same crop unnormalised in [0, 1])."""
    import torch
    from PIL import Image, UnidentifiedImageError

    from .data.transforms import eval_transform

    try:
        img = Image.open(path).convert("L" if cfg.in_chans == 1 else "RGB")
    except (OSError, UnidentifiedImageError) as e:
        raise SystemExit(f"error: cannot read image {path!r}: {e}") from None
    x = eval_transform(cfg)(img)[None]
    mean = torch.tensor(cfg.mean[: cfg.in_chans]).view(-1, 1, 1)
    std = torch.tensor(cfg.std[: cfg.in_chans]).view(-1, 1, 1)
    return x, (x[0] * std + mean).clamp(0, 1)


def _onnx_classifier(path: str):
    """(names, image path -> probabilities) of an exported ONNX model, run by onnxruntime."""
    import torch
    from PIL import Image, UnidentifiedImageError

    try:
        from vitkit.tools.export import OnnxModel
        model = OnnxModel(path)
    except ImportError as e:
        raise SystemExit(f"error: --onnx needs onnxruntime ({e}); pip install 'vitkit[export]'") from None
    except Exception as e:  # noqa: BLE001 - onnxruntime's own errors for a missing or damaged file
        raise SystemExit(f"error: cannot load {path!r} in onnxruntime: {e}") from None
    n = model.session.get_outputs()[0].shape[-1]
    names = model.labels or [str(i) for i in range(n if isinstance(n, int) else 0)]

    def probabilities(image: str) -> torch.Tensor:
        try:
            img = Image.open(image)
        except (OSError, UnidentifiedImageError) as e:
            raise SystemExit(f"error: cannot read image {image!r}: {e}") from None
        return torch.from_numpy(model(model.preprocess(img))).softmax(-1)[0]

    return names, probabilities


def predict(args: argparse.Namespace) -> int:
    import torch

    if args.topk < 1:
        raise SystemExit(f"error: --topk expects a whole number of classes of 1 or more, got {args.topk}")

    if args.onnx and args.token_merging:
        raise SystemExit("error: --token-merging applies to PyTorch models; an ONNX file merges tokens as it was "
                         "exported (vitkit export --token-merging R)")
    if args.onnx:
        names, probabilities = _onnx_classifier(args.onnx)
    else:
        net = _load(args)
        names = getattr(net, "class_names", None) or [str(i) for i in range(net.cfg.num_classes)]
        _refuse_an_embedding(net, args.model, args.checkpoint)

        def probabilities(image: str) -> torch.Tensor:
            x, _ = _image(image, net.cfg)
            with torch.no_grad():
                return net(x).softmax(-1)[0]

    failed = 0
    for path in args.images:
        try:
            p = probabilities(path)
        except SystemExit as e:  # its message says "error: ..." already
            print(f"{path}: {e}", file=sys.stderr)
            failed += 1
            continue
        if len(names) < len(p):
            names = [str(i) for i in range(len(p))]
        top = p.topk(min(args.topk, len(p)))
        print(f"{path}: " + ", ".join(f"{names[i]} {v:.3f}" for v, i in zip(top.values.tolist(), top.indices.tolist(),
                                                                           strict=True)))
    return 1 if failed else 0


def export(args: argparse.Namespace) -> int:
    """A preset, a tag or any checkpoint -> ONNX (checked in onnxruntime) or a torch.export program."""
    import vitkit
    from vitkit.tools.export import ExportError, export_onnx, export_program

    if args.output:  # before the model is built: a folder on the way that is a file
        parent = Path(args.output).parent
        blocking = next((p for p in (parent, *parent.parents) if p.exists() and not p.is_dir()), None)
        if blocking is not None:
            raise SystemExit(f"error: -o {args.output}: {blocking} is a file, not a folder")
    overrides = _overrides(args.overrides)
    if args.img_size:
        overrides["img_size"] = args.img_size[0] if len(args.img_size) == 1 else tuple(args.img_size)
    if args.token_merging and not Path(args.src).exists():
        overrides["token_merging"] = args.token_merging
    if Path(args.src).exists():
        args.checkpoint, args.overrides = args.src, json.dumps(overrides)
        net = _load(args)
    else:  # a preset (random weights, for trying the export) or pretrained weights by tag
        name = args.src
        tagged = "." in name or name.startswith("hf-hub:")
        from vitkit.checkpoints.hub import MissingWeightsError

        try:
            net = vitkit.create_model(name, pretrained=tagged, **overrides).eval()
        except MissingWeightsError as e:
            raise SystemExit(f"error: {e}") from None
        except ValueError as e:
            if "token_merging" in overrides:
                raise SystemExit(f"error: --token-merging {args.token_merging}: {e}") from None
            raise SystemExit(f"error: {args.src!r} is neither a file nor a model vitkit knows: {e}") from None
        except KeyError as e:
            raise SystemExit(f"error: {args.src!r} is neither a file nor a model vitkit knows: {e}") from None
        if tagged:
            _require_classifier(net, name)
        if not tagged:
            print(f"{name}: no weights given, so the export holds a random initialisation (give a checkpoint file "
                  "or a tag such as vit_base_patch16_224.augreg2_in21k_ft_in1k for trained weights)", file=sys.stderr)
    out = args.output or f"{net.name}.{'onnx' if args.format == 'onnx' else 'pt2'}"
    dynamic = False if args.fixed_size else None
    try:
        if args.format == "onnx":
            report = export_onnx(net, out, dynamic_size=dynamic, opset=args.opset, atol=args.atol)
        else:
            report = export_program(net, out, dynamic_size=dynamic, atol=args.atol)
    except ExportError as e:
        raise SystemExit(f"error: {e}") from None
    except ImportError as e:
        raise SystemExit(f"error: ONNX export needs onnx, onnxscript and onnxruntime ({e}); "
                         "pip install 'vitkit[export]'") from None
    print(report)
    return 0


def download(args: argparse.Namespace) -> int:
    """Fetch pretrained weights into their cache (the Hugging Face cache, or torch hub's), for offline use."""
    from vitkit.checkpoints.hub import MissingWeightsError, resolve

    if args.dataset:
        return _download_datasets(args)
    failed = 0
    for name in args.names:
        try:
            source = resolve(name, any_architecture=True)
            path = source.cached()
            state = "already cached"
            if path is None:
                path, state = source.download(), "downloaded"
        except (MissingWeightsError, ValueError) as e:
            print(f"{name}: error: {e}", file=sys.stderr)
            failed += 1
            continue
        print(f"{source.name}: {state}: {path}")
    return 1 if failed else 0


def _download_datasets(args: argparse.Namespace) -> int:
    """Fetch Hugging Face datasets into the datasets cache (HF_DATASETS_CACHE), which training reads offline."""
    from vitkit.data.hf import cache_dir, download

    failed = 0
    for name in args.names:
        try:
            rows = download(name, args.config_name, args.revision)
        except Exception as e:  # noqa: BLE001 - the datasets library's own errors (network, no such dataset)
            from .errors import one_line

            print(f"{name}: {one_line(e)}", file=sys.stderr)
            failed += 1
            continue
        print(f"{name}: in {cache_dir()}: " + ", ".join(f"{k} {v} rows" for k, v in rows.items()))
    return 1 if failed else 0


def models(args: argparse.Namespace) -> int:
    import torch

    import vitkit
    from vitkit.models.config import pair
    from vitkit.tools.flops import count_gmacs_of

    rows = []
    for name in vitkit.list_models(args.pattern):
        fam, cfg = vitkit.family(name), vitkit.get_config(name)
        if fam == "seq2seq":
            kw = dict(src_vocab_size=32000, tgt_vocab_size=32000)
            cfg = vitkit.get_config(name, **kw)
            with torch.device("meta"):
                params = sum(p.numel() for p in vitkit.create_model(name, **kw).parameters())
            size = "-" if cfg.vision_encoder is None else "x".join(map(str, cfg.vision_overrides["img_size"]))
            rows.append((name, f"{params / 1e6:.1f}", "-", size, fam))
            continue
        with torch.device("meta"):
            params = sum(p.numel() for p in vitkit.create_model(name).parameters())
        shape = (cfg.in_chans, *pair(cfg.img_size))
        gmacs = "-" if args.no_flops else f"{count_gmacs_of(lambda n=name: vitkit.create_model(n), shape):.2f}"
        rows.append((name, f"{params / 1e6:.1f}", gmacs, "x".join(map(str, shape[1:])), fam))
    head = ("name", "params (M)", "GMACs", "img size", "family")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, tuple("-" * w for w in widths), *rows]:
        print("  ".join(c.ljust(w) if i == 0 or i == 4 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths,
                                                                                                        strict=True))))
    return 0


def bench(rest: list[str]) -> int:
    from vitkit.tools.bench import main as bench_main

    bench_main(rest)
    return 0


def convert(args: argparse.Namespace) -> int:
    """Any format vitkit reads -> a vitkit/timm export folder, or a timm state dict (.safetensors / .pth / .bin)."""
    import torch

    import vitkit
    from vitkit.checkpoints.files import atomic_write, write_safetensors

    if (args.dst is None) == (args.output is None):
        raise SystemExit("error: give the destination once: `vitkit convert SRC DST` or `vitkit convert SRC -o DST`")
    args.dst = args.dst or args.output
    if args.adapter:
        return _convert_adapter(args.src, Path(args.dst))
    net = vitkit.create_model(args.model, checkpoint=args.src, **_overrides(args.overrides))
    dst = Path(args.dst)
    if dst.suffix == ".safetensors":
        write_safetensors(net.state_dict(), dst, metadata={"format": "pt"})
    elif dst.suffix in (".pth", ".pt", ".bin"):
        atomic_write(dst, lambda tmp: torch.save(net.state_dict(), tmp))
    elif dst.suffix == "":
        vitkit.save_pretrained(net, dst, class_names=getattr(net, "class_names", None))
    else:
        raise SystemExit(f"error: unknown destination {args.dst!r}: expected a folder, .safetensors, .pth, .pt or .bin")
    print(f"{args.src} ({net.load_report.format}) -> {dst} as {net.name} in timm / vitkit names")
    return 0


def _convert_adapter(src: str, dst: Path) -> int:
    """A LoRA run's Lightning checkpoint -> peft's adapter folder, the classifier among the modules it saves."""
    import torch

    import vitkit
    from vitkit.checkpoints.adapt import classifier_names
    from vitkit.lora import adapted_model, save_adapter

    raw = torch.load(src, map_location="cpu", weights_only=True) if Path(src).is_file() else {}
    hp = raw.get("hyper_parameters") or {} if isinstance(raw, dict) else {}
    if not hp.get("lora_rank"):
        raise SystemExit(f"error: --adapter takes the checkpoint of a LoRA run (--model.lora_rank > 0); {src} is not "
                         "one")
    trained = {k[len("model."):]: v for k, v in raw["state_dict"].items() if k.startswith("model.")}
    model = adapted_model(hp, trained, Path(src), vitkit.create_model)
    heads = classifier_names(model)
    save_adapter(model, dst, base_model=hp.get("checkpoint") or hp["model_name"],
                 head=[heads] if isinstance(heads, str) else list(heads))
    print(f"{src} -> {dst}: peft adapter folder for {model.name} ({len(trained)} tensors; base model: "
          f"{hp.get('checkpoint') or hp['model_name']})")
    return 0


def attention_map(args: argparse.Namespace) -> int:
    from .tools.plots import attention_rollout, overlay, swin_window_attention

    net = _load(args)
    x, shown = _image(args.image, net.cfg)
    if hasattr(net, "blocks"):  # ViT: rollout over every layer
        maps = net.attention_maps(x)
        heat = attention_rollout(maps, net.num_prefix_tokens, net.cfg.grid_size)[0]
        title = f"attention rollout, {len(maps)} layers"
    else:  # Swin: attention received per position inside the windows of one block
        attn, plan = net.attention_maps(x, stage=args.stage, block=args.block)
        heat = swin_window_attention(attn, plan)  # attn: (nW, heads, N, N) for the one image
        title = f"stage {args.stage} block {args.block}, windows {plan.window[0]}x{plan.window[1]}"
    print(overlay(shown, heat, args.output, title))
    return 0


def _described(model) -> str:
    """A model's preset and the sizes it changed (``vit_tiny_patch16_224, patch 4, 32 px``): a preset name alone
    would name the preset's own patch and image size."""
    import dataclasses

    from vitkit.models.registry import preset_config

    cfg, preset = dataclasses.asdict(model.cfg), dataclasses.asdict(preset_config(model.name))
    shown = {"patch_size": "patch {}", "img_size": "{} px", "embed_dim": "width {}", "depth": "depth {}",
             "depths": "depths {}", "window_size": "window {}"}
    changed = [form.format(cfg[k] if not isinstance(cfg[k], (list, tuple)) or len(set(cfg[k])) > 1 else cfg[k][0])
               for k, form in shown.items() if k in cfg and cfg[k] != preset[k]]
    return ", ".join([model.name, *changed])


def reconstruct(args: argparse.Namespace) -> int:
    """A masked-image model's original / masked / reconstruction grid for image files."""
    import torch

    import vitkit

    from .tools.plots import draw_reconstructions

    mim = {"mask_ratio": args.mask_ratio} if args.mask_ratio is not None else {}
    net = vitkit.create_mim(args.model, checkpoint=args.checkpoint, objective=args.objective, mim=mim,
                            **_overrides(args.overrides)).eval()
    cfg = net.encoder.cfg
    x = torch.cat([_image(path, cfg)[0] for path in args.images])
    torch.manual_seed(args.seed)
    print(draw_reconstructions(net, x, None, cfg.mean, cfg.std, args.output,
                               f"{net.cfg.__class__.__name__.removesuffix('Config')}: {_described(net.encoder)}"))
    return 0


def pos_embed(args: argparse.Namespace) -> int:
    import vitkit

    from .tools.plots import pos_embed_similarity

    net = _load(args)
    if not hasattr(net, "pos_embed"):
        raise SystemExit(f"error: {net.name} has no absolute position embedding (Swin uses relative biases)")
    fixed = vitkit.create_model(net.name, **{**dataclasses.asdict(net.cfg), "pos_embed": "sincos"})
    print(pos_embed_similarity({f"{net.name} (learned)": net, "2-D sin-cos (fixed)": fixed}, args.output))
    return 0


def prepare_data(args: argparse.Namespace) -> int:
    import logging

    from .data.shards import MARKER, prepare_data

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        summary = prepare_data(args.root, args.out, workers=args.workers, chunk_bytes=args.chunk_bytes,
                               overwrite=args.overwrite, seed=args.seed)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    for split, n in summary["splits"].items():
        print(f"{split}: {n['samples']} samples, {n['skipped']} unreadable file(s) left out")
    print(f"{len(summary['classes'])} classes; {Path(args.out) / MARKER} written: the dataset is complete")
    return 0


def recipes(args: argparse.Namespace) -> int:
    from .recipes import list_recipes, recipes_dir

    found = list_recipes()
    width = max(map(len, found))
    for name, what in found.items():
        print(f"{name:<{width}}  {what}")
    print(f"({len(found)} recipes in {recipes_dir()}; train one with `vitkit train fit --config NAME`)")
    return 0
