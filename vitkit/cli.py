"""The ``vitkit`` command: train, recipes, predict, export, prepare-data, download, models, bench, convert, plots.

    vitkit train fit --config vit_tiny_digits                      # a recipe by name (= python train.py fit ...)
    vitkit recipes                                                 # the recipes that ship with vitkit
    vitkit predict cat.jpg dog.png --checkpoint runs/.../best.ckpt --topk 3
    vitkit predict cat.jpg --model vit_base_patch16_224.augreg2_in21k_ft_in1k   # pretrained, by timm's tag
    vitkit download vit_base_patch16_224.augreg2_in21k_ft_in1k Swin_T_Weights.IMAGENET1K_V1
    vitkit models 'swin*'
    vitkit prepare-data ~/data/imagenet ~/data/imagenet-shards   # ImageNet folders -> litdata shards
    vitkit bench --models vit_base_patch16_224 --peers timm       # throughput beside timm (vitkit/tools/bench.py)
    vitkit convert vit_b_16.pth export/ --model vit_base_patch16_224
    vitkit export runs/.../best.ckpt -o model.onnx                # ONNX, checked in onnxruntime
    vitkit predict cat.jpg --onnx model.onnx
    vitkit attention-map cat.jpg --checkpoint best.ckpt -o attention.png
    vitkit reconstruct img.png --checkpoint runs/mae_vit_tiny_digits/checkpoints/last.ckpt -o grid.png
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch

TOKEN_MERGING = ("ToMe: merge R token pairs in every block (ViT/DeiT; Bolya et al., 2023), faster at some cost in "
                 "accuracy; 0: off")
OVERRIDES = "config fields as JSON, for files that do not record them, e.g. '{\"depth\": 6, \"img_size\": 384}'"


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
                         "it first, e.g. `vitkit train fit --config configs/vit_base_finetune.yaml --model.model_name "
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
                     + f" it: `vitkit train fit --config configs/vit_base_clip_finetune.yaml {source} "
                     "--data.root DATA`")


def _image(path: str, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """(model input (1, C, H, W) after the model's eval transform, the same crop unnormalised in [0, 1])."""
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
        except SystemExit as e:
            print(f"{path}: error: {e}", file=sys.stderr)
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
    import vitkit
    from vitkit.checkpoints.files import atomic_write, write_safetensors

    if (args.dst is None) == (args.output is None):
        raise SystemExit("error: give the destination once: `vitkit convert SRC DST` or `vitkit convert SRC -o DST`")
    net = vitkit.create_model(args.model, checkpoint=args.src, **_overrides(args.overrides))
    args.dst = args.dst or args.output
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


def reconstruct(args: argparse.Namespace) -> int:
    """A masked-image model's original / masked / reconstruction grid for image files."""
    import vitkit

    from .tools.plots import draw_reconstructions

    mim = {"mask_ratio": args.mask_ratio} if args.mask_ratio is not None else {}
    net = vitkit.create_mim(args.model, checkpoint=args.checkpoint, objective=args.objective, mim=mim,
                            **_overrides(args.overrides)).eval()
    cfg = net.encoder.cfg
    x = torch.cat([_image(path, cfg)[0] for path in args.images])
    torch.manual_seed(args.seed)
    print(draw_reconstructions(net, x, None, cfg.mean, cfg.std, args.output,
                               f"{net.cfg.__class__.__name__.removesuffix('Config')}: {net.name}"))
    return 0


def pos_embed(args: argparse.Namespace) -> int:
    import vitkit

    from .tools.plots import pos_embed_similarity

    net = _load(args)
    if not hasattr(net, "pos_embed"):
        raise SystemExit(f"error: {net.name} has no absolute position embedding (Swin uses relative biases)")
    fixed = vitkit.create_model(net.name, **{**vars(net.cfg), "pos_embed": "sincos"})
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


def main(argv: list[str] | None = None) -> int:
    """Run a subcommand; bad input ends it with one ``error:`` line and exit status 1 (``vitkit/errors.py``)."""
    from .errors import one_line, take_traceback_flag, user_error, wants_traceback

    from_shell = argv is None
    argv = take_traceback_flag(list(sys.argv[1:] if argv is None else argv))
    try:
        return _run(argv, from_shell)
    except Exception as e:
        cause = user_error(e)
        if cause is None or wants_traceback():
            raise
        print(one_line(cause), file=sys.stderr)
        return 1


def _run(argv: list[str], from_shell: bool) -> int:
    if argv[:1] == ["train"]:  # everything after `train` belongs to LightningCLI
        from vitkit.lit.lightning_cli import cli_main

        # sys.argv stays as typed (this script, then `train ...`): Lightning starts the other processes of a
        # multi-device run by running that same command line again. LightningCLI then warns that it was given
        # both; that is the point here.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
            cli_main(argv[1:], prog=f"{Path(sys.argv[0]).name} train" if from_shell else "vitkit train")
        return 0
    if argv[:1] == ["bench"]:
        return bench(argv[1:])
    if argv[:1] == ["evaluate"]:  # its data arguments are the training command's (--data CLASS, --data.root DIR)
        from vitkit.lit.evaluate import main as evaluate

        return evaluate(argv[1:])
    args = parser().parse_args(argv)
    return args.fn(args)


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser, whose errors are one ``error:`` line and exit status 1, as the other errors of vitkit."""

    def error(self, message: str):
        self.exit(1, f"error: {message} (`{self.prog} --help` lists the options)\n")


def parser() -> argparse.ArgumentParser:
    """The ``vitkit`` command's parser (``train`` and ``bench`` pass their arguments on as they are)."""
    p = OneLineParser(prog="vitkit", description=__doc__.split("\n")[0],
                      formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 1)[1])
    p.add_argument("--traceback", action="store_true", help="show the traceback of an error instead of its one line "
                                                             "(or set VITKIT_TRACEBACK=1)")
    sub = p.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    sub.add_parser("train", help="LightningCLI, the same as `python train.py ...`")
    sub.add_parser("bench", help="img/s, GMACs, MFU and memory beside timm and torchvision (see `vitkit bench --help`)")
    _model_commands(sub)
    _data_and_plot_commands(sub)
    return p


def _model_commands(sub) -> None:
    """predict, export, download, models."""
    sub.add_parser("evaluate", help="scores, per-class metrics, confusion matrix, mistakes and calibration of a "
                                    "classifier on a data split; k-NN / linear probe of a backbone", add_help=False)
    s = sub.add_parser("predict", help="top-k classes for image files")
    s.add_argument("images", nargs="+")
    s.add_argument("--checkpoint", help="any format vitkit reads (a .ckpt keeps the class names)")
    s.add_argument("--model", help="without --checkpoint: pretrained weights by name (a timm tag or torchvision "
                                   "weights); with it: the preset, for formats that do not record it")
    s.add_argument("--overrides", default="{}", help=OVERRIDES)
    s.add_argument("--topk", type=int, default=5)
    s.add_argument("--onnx", help="an exported model.onnx, run by onnxruntime with the preprocessing in its metadata")
    s.add_argument("--token-merging", type=int, default=0, metavar="R", help=TOKEN_MERGING)
    s.set_defaults(fn=predict)
    s = sub.add_parser("export", help="a model or checkpoint -> ONNX (checked in onnxruntime) or torch.export .pt2")
    s.add_argument("src", help="a checkpoint in any format vitkit reads, a preset name, or a timm tag")
    s.add_argument("-o", "--output", help="output file (default: <model>.onnx or <model>.pt2)")
    s.add_argument("--format", choices=["onnx", "torch-export"], default="onnx")
    s.add_argument("--model", help="the preset, for checkpoint formats that do not record it")
    s.add_argument("--overrides", default="{}", help=OVERRIDES)
    s.add_argument("--img-size", type=int, nargs="+", help="export at this size (H [W]); positions and windows are "
                                                           "resized as on load")
    s.add_argument("--fixed-size", action="store_true", help="export height and width fixed (default: dynamic)")
    s.add_argument("--token-merging", type=int, default=0, metavar="R", help=TOKEN_MERGING)
    s.add_argument("--opset", type=int, default=18, help="ONNX opset, 18 or newer")
    s.add_argument("--atol", type=float, default=1e-4, help="largest difference to PyTorch the check accepts")
    s.set_defaults(fn=export)
    s = sub.add_parser("download", help="fetch pretrained weights by name into their cache, for offline use")
    s.add_argument("names", nargs="+", help="timm tags (vit_small_patch16_224.augreg_in21k_ft_in1k, or any timm "
                                            "model's, as a teacher's: regnety_160.deit_in1k), torchvision weights "
                                            "(Swin_T_Weights.IMAGENET1K_V1) or hf-hub:REPO; with --dataset, "
                                            "Hugging Face dataset names")
    s.add_argument("--dataset", action="store_true", help="the names are datasets (beans, timm/mini-imagenet), "
                                                          "fetched into HF_DATASETS_CACHE for --data.name")
    s.add_argument("--config-name", default=None, help="with --dataset: the dataset's configuration")
    s.add_argument("--revision", default=None, help="with --dataset: a branch, tag or commit")
    s.set_defaults(fn=download)
    s = sub.add_parser("models", help="table of presets: params, GMACs, image size, family")
    s.add_argument("pattern", nargs="?", default="*")
    s.add_argument("--no-flops", action="store_true", help="skip counting GMACs")
    s.set_defaults(fn=models)


def _data_and_plot_commands(sub) -> None:
    """recipes, prepare-data, convert, attention-map, reconstruct, pos-embed."""
    s = sub.add_parser("recipes", help="the training recipes that ship with vitkit, one line each")
    s.set_defaults(fn=recipes)
    s = sub.add_parser("prepare-data", help="ImageNet-layout folders -> litdata shards for StreamingImageDataModule")
    s.add_argument("root", help="a folder with train/<class>/<images>, val/<class>/<images> and optionally test/")
    s.add_argument("out", help="the output folder; run again on it to resume an interrupted conversion")
    s.add_argument("--workers", type=int, default=None, help="parallel workers (default: every CPU)")
    s.add_argument("--chunk-bytes", default="64MB", help="size of a shard file (default: 64MB)")
    s.add_argument("--overwrite", action="store_true", help="delete OUT and convert from the start")
    s.add_argument("--seed", type=int, default=0, help="seed of the random order each split is written in (default: 0)")
    s.set_defaults(fn=prepare_data)
    s = sub.add_parser("convert", help="any checkpoint format -> vitkit/timm folder or state-dict file")
    s.add_argument("src", help="any format vitkit reads, a sharded (FSDP2) checkpoint folder included")
    s.add_argument("dst", nargs="?", help="a folder (model.safetensors + config.json), or a .safetensors / .pth / "
                   ".bin file")
    s.add_argument("-o", "--output", help="the destination, as DST")
    s.add_argument("--model", help="preset name, for formats that do not record it")
    s.add_argument("--overrides", default="{}", help=OVERRIDES)
    s.set_defaults(fn=convert)
    s = sub.add_parser("attention-map", help="attention over an image: rollout (ViT) or per-window (Swin)")
    s.add_argument("image")
    s.add_argument("--checkpoint", help="any format vitkit reads; without it, --model names pretrained weights")
    s.add_argument("--model")
    s.add_argument("--overrides", default="{}", help=OVERRIDES)
    s.add_argument("-o", "--output", default="attention.png")
    s.add_argument("--stage", type=int, default=0, help="Swin: which stage")
    s.add_argument("--block", type=int, default=1, help="Swin: which block (1 = the first shifted one)")
    s.set_defaults(fn=attention_map)
    s = sub.add_parser("reconstruct", help="a pre-training checkpoint's original / masked / reconstruction grid")
    s.add_argument("images", nargs="+")
    s.add_argument("--checkpoint", required=True, help="a pre-training run's checkpoint, Meta's mae_visualize_* file "
                                                       "or a transformers ViTMAE / MaskedImageModeling folder")
    s.add_argument("--model", help="the encoder preset, for files that do not record it")
    s.add_argument("--objective", choices=["mae", "simmim"], help="for files that do not record it")
    s.add_argument("--mask-ratio", type=float, help="hide this fraction (default: the checkpoint's)")
    s.add_argument("--overrides", default="{}", help=OVERRIDES)
    s.add_argument("--seed", type=int, default=0, help="seed of the mask")
    s.add_argument("-o", "--output", default="reconstruction.png")
    s.set_defaults(fn=reconstruct)
    s = sub.add_parser("pos-embed", help="similarity of learned position embeddings, beside fixed 2-D sin-cos")
    s.add_argument("--checkpoint", help="any format vitkit reads; without it, --model names pretrained weights")
    s.add_argument("--model")
    s.add_argument("--overrides", default="{}", help=OVERRIDES)
    s.add_argument("-o", "--output", default="pos_embed.png")
    s.set_defaults(fn=pos_embed)


if __name__ == "__main__":
    sys.exit(main())
