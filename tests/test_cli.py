"""The `vitkit` command: every subcommand runs on files the test writes, and the pictures are produced."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import vitkit
from tests import forkserver
from vitkit.cli import main

from .commands import error_line_of

ROOT = Path(__file__).resolve().parents[1]
VIT_KW = dict(img_size=32, patch_size=8, depth=2, num_classes=4)
SWIN_KW = dict(img_size=32, embed_dim=16, depths=(2, 2), num_heads=(1, 2), window_size=4, num_classes=4)


def _png(path: Path, seed: int = 0, size=(40, 48)) -> Path:
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)).save(path)
    return path


def _is_png(path: Path) -> bool:
    with Image.open(path) as im:
        return im.format == "PNG" and min(im.size) > 100


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("exports")
    torch.manual_seed(0)
    vit = vitkit.create_model("vit_tiny_patch16_224", **VIT_KW)
    swin = vitkit.create_model("swin_tiny_patch4_window7_224", **SWIN_KW)
    names = ["ant", "bee", "cat", "dog"]
    return vitkit.save_pretrained(vit, root / "vit", names), vitkit.save_pretrained(swin, root / "swin", names)


def test_console_script_is_installed():
    exe = Path(sys.executable).parent / "vitkit"
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "attention-map" in out.stdout


def test_vitkit_recipes_says_each_recipes_hardware_data_and_time_in_whole_sentences(capsys):
    """`vitkit recipes`: each recipe's hardware as its trainer section asks for it (a GPU-only recipe says so), its
    data and time scale from its header, and what it trains in whole sentences (never cut at a line's end)."""
    import yaml

    from vitkit.cli import main
    from vitkit.recipes import list_recipes

    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    for name, info in list_recipes().items():
        trainer = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())["trainer"]
        gpu_only = trainer.get("accelerator") == "gpu"
        assert info.hardware.endswith("(GPU only)") == gpu_only and info.data and info.time, (name, info)
        assert ("CPU" in info.hardware) == (not gpu_only), (name, info)
        if trainer.get("devices") not in (None, "auto", 1):
            assert f"{trainer['devices']} GPUs" in info.hardware, (name, info)
        assert info.summary.endswith((".", ")")) and info.summary[0].isupper(), (name, info.summary)
        assert f"{name}: {info.hardware}; {info.data}; {info.time}" in out


@pytest.mark.slow
def test_help_and_recipes_answer_without_importing_torch():
    """The first commands a newcomer types answer at once: torch (seconds to import) is imported by the commands
    that need it, and `import vitkit` gives its names when first used."""
    code = ("import sys\nfrom vitkit.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "assert main(['recipes']) == 0\nassert 'torch' not in sys.modules, 'torch was imported'\n"
            "import vitkit\nassert 'torch' not in sys.modules\nassert callable(vitkit.create_model) and 'torch' in "
            "sys.modules\nassert vitkit.models.list_models('vit_tiny_*') == vitkit.list_models('vit_tiny_*')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "attention-map" in out.stdout and "vit_tiny_digits" in out.stdout
    with pytest.raises(AttributeError, match="module 'vitkit' has no attribute 'no_such_name'"):
        vitkit.no_such_name  # noqa: B018


@pytest.mark.slow
def test_predict_prints_topk_class_names(exports, tmp_path, capsys):
    a, b = _png(tmp_path / "a.png"), _png(tmp_path / "b.png", seed=1)
    (tmp_path / "broken.jpg").write_bytes(b"not a jpeg")
    assert main(["predict", str(a), str(b), str(tmp_path / "broken.jpg"), "--checkpoint", str(exports[0]),
                 "--topk", "2"]) == 1  # one file could not be read
    out, err = capsys.readouterr()
    lines = out.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"{a}: ")
    preds = [p.rsplit(" ", 1) for p in lines[0].split(": ", 1)[1].split(", ")]
    assert len(preds) == 2 and all(n in ("ant", "bee", "cat", "dog") for n, _ in preds)
    assert float(preds[0][1]) >= float(preds[1][1])
    model = vitkit.create_model(checkpoint=exports[0]).eval()
    from vitkit.data.transforms import eval_transform

    with torch.no_grad():
        p = model(eval_transform(model.cfg)(Image.open(a).convert("RGB"))[None]).softmax(-1)[0]
    assert preds[0][0] == ["ant", "bee", "cat", "dog"][int(p.argmax())]
    assert f"{p.max():.3f}" == preds[0][1]
    assert "cannot read image" in err and "broken.jpg" in err


def test_models_table(capsys):
    assert main(["models", "swin_tiny*"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("swin_tiny_patch4_window7_224"))
    name, params, gmacs, size, family = row.split()
    assert (params, size, family) == ("28.3", "224x224", "swin")
    assert abs(float(gmacs) - 4.51) / 4.51 < 0.03  # Swin-T's published 4.5 GMACs, whatever the counter's rounding


def test_convert_torchvision_to_export_and_timm_file(tmp_path):
    from torchvision.models.vision_transformer import VisionTransformer

    tv = VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=3, hidden_dim=192, mlp_dim=768,
                           num_classes=4).eval()
    torch.save(tv.state_dict(), tmp_path / "tv.pth")
    assert main(["convert", str(tmp_path / "tv.pth"), str(tmp_path / "out"), "--model", "vit_tiny_patch16_224",
                 "--overrides", '{"img_size": 32, "patch_size": 8, "depth": 2}']) == 0
    assert main(["convert", str(tmp_path / "out"), str(tmp_path / "w.safetensors")]) == 0
    import timm
    from safetensors.torch import load_file

    theirs = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=4).eval()
    theirs.load_state_dict(load_file(tmp_path / "w.safetensors"), strict=True)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(theirs(x), tv(x), atol=1e-4, rtol=0)


@pytest.mark.parametrize("which", [0, 1], ids=["vit_rollout", "swin_windows"])
def test_attention_map_writes_a_png(which, exports, tmp_path, capsys):
    out = tmp_path / "att.png"
    assert main(["attention-map", str(_png(tmp_path / "x.png")), "--checkpoint", str(exports[which]),
                 "-o", str(out)]) == 0
    assert _is_png(out) and str(out) in capsys.readouterr().out


@pytest.mark.slow
def test_pos_embed_plot_writes_a_png(exports, tmp_path):
    out = tmp_path / "pe.png"
    assert main(["pos-embed", "--checkpoint", str(exports[0]), "-o", str(out)]) == 0
    assert _is_png(out)


@pytest.mark.slow
def test_train_and_bench_pass_their_arguments_through(tmp_path):
    main(["train", "fit", "--config", str(ROOT / "configs/vit_tiny_digits.yaml"), "--trainer.accelerator", "cpu",
          "--trainer.max_steps", "2", "--trainer.limit_val_batches", "1", "--trainer.val_check_interval", "2",
          "--model.model_overrides", '{"depth": 1, "embed_dim": 32, "num_heads": 2, "patch_size": 8}',
          "--trainer.default_root_dir", str(tmp_path)])
    curves = next(tmp_path.rglob("curves.png"))  # drawn from metrics.csv at the end of fit
    assert _is_png(curves) and (curves.parent / "metrics.csv").exists()
    main(["bench", "--models", "vit_tiny_patch16_224", "--peers", "", "--mode", "infer", "--batch-sizes", "2",
          "--rounds", "1", "--iters", "1", "--warmup", "1", "--no-mem", "--out", str(tmp_path / "b.csv")])
    assert (tmp_path / "b.csv").exists() and (tmp_path / "b.png").exists()


@pytest.mark.slow
def test_vitkit_train_from_the_shell_prints_no_argv_warning(tmp_path):
    """`vitkit train ...` as a user types it: LightningCLI reads the arguments itself, without its warning
    about `args` given together with sys.argv, and the run lands under its root."""
    exe = Path(sys.executable).parent / "vitkit"
    out = subprocess.run([str(exe), "train", "fit", "-c", str(ROOT / "configs/vit_tiny_digits.yaml"),
                          "--trainer.accelerator=cpu", "--trainer.max_steps=1", "--trainer.logger=false",
                          f"--trainer.default_root_dir={tmp_path / 'run'}", "--model.model_overrides",
                          '{"depth": 1, "embed_dim": 32, "num_heads": 2, "patch_size": 8}'],
                         cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "args parameter" not in out.stderr + out.stdout
    assert (tmp_path / "run/checkpoints/last.ckpt").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["run"]


@pytest.fixture(scope="module")
def wheel_site(tmp_path_factory) -> Path:
    """vitkit as pip installs it from its wheel, into a folder of its own (its dependencies are this venv's)."""
    tmp = tmp_path_factory.mktemp("wheel")
    wheel = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp / "dist"), str(ROOT)], capture_output=True, text=True, timeout=240)
    assert wheel.returncode == 0, wheel.stderr[-2000:]
    site = tmp / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                    *map(str, (tmp / "dist").glob("vitkit-*.whl"))], check=True, timeout=240)
    return site


def _from_wheel(site: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """``vitkit ARGS`` (or ``python -m vitkit.demo`` for ``demo``) run from ``cwd``, outside the source tree, with
    the installed wheel first on the path."""
    code = ("import sys, vitkit; assert 'site' in vitkit.__file__, vitkit.__file__; "
            + ("from vitkit.demo import main; main(sys.argv[2:])" if args[0] == "demo" else
               "from vitkit.cli import main; sys.exit(main(sys.argv[1:]))"))
    # a fork of an interpreter that imported vitkit's libraries but not vitkit, which the child imports from `site`
    return forkserver.run(["-c", code, *args], cwd=cwd, env={**os.environ, "PYTHONPATH": str(site)}, timeout=300,
                          preload="libraries")


TINY = '{"depth": 1, "embed_dim": 32, "num_heads": 2, "patch_size": 8}'


@pytest.mark.slow
def test_bench_runs_from_an_installed_wheel(wheel_site, tmp_path):
    """The package as pip installs it, outside the source tree: `vitkit bench` needs nothing from benchmarks/."""
    out = _from_wheel(wheel_site, tmp_path, "bench", "--models", "vit_tiny_patch16_224", "--peers", "",
                      "--batch-sizes", "2", "--rounds", "1", "--iters", "1", "--warmup", "1", "--no-mem",
                      "--out", "b/t.csv")
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "b/t.csv").exists() and (tmp_path / "b/t.png").exists()


@pytest.mark.slow
def test_the_wheel_carries_every_package_and_the_recipes(wheel_site):
    packages = sorted(".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "vitkit").rglob("__init__.py"))
    installed = sorted(".".join(p.parent.relative_to(wheel_site).parts) for p in (wheel_site / "vitkit").rglob(
        "__init__.py"))
    assert installed == packages
    recipes = sorted(p.name for p in (wheel_site / "vitkit/configs").glob("*.yaml"))
    assert recipes == sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))


@pytest.mark.slow
def test_demo_train_and_recipes_run_from_an_installed_wheel(wheel_site, tmp_path):
    """`python -m vitkit.demo` and `vitkit train fit --config NAME` read the recipes inside the wheel."""
    demo = _from_wheel(wheel_site, tmp_path, "demo", "--trainer.max_epochs", "1", "--trainer.limit_train_batches",
                       "2", "--trainer.limit_val_batches", "1", "--model.model_overrides", TINY,
                       "--trainer.enable_progress_bar", "false")
    assert demo.returncode == 0, demo.stderr[-2000:]
    assert "digits demo: val top-1" in demo.stdout and list(tmp_path.glob("runs/digits_demo/*/checkpoints/*.ckpt"))
    train = _from_wheel(wheel_site, tmp_path, "train", "fit", "--config", "swin_tiny_digits",
                        "--trainer.fast_dev_run", "1", "--trainer.accelerator", "cpu")
    assert train.returncode == 0, train.stderr[-2000:]
    listing = _from_wheel(wheel_site, tmp_path, "recipes")
    assert listing.returncode == 0, listing.stderr[-2000:]
    lines = listing.stdout.splitlines()
    named = [line for line in lines if not line.startswith(" ")][:-1]  # each recipe's line; its prose indented
    assert len(named) == len(list((ROOT / "configs").glob("*.yaml")))
    assert any(line.startswith("vit_tiny_digits: CPU") and "digits" in line for line in lines)
    assert str(wheel_site / "vitkit" / "configs") in lines[-1]


def test_a_recipe_by_name_and_an_unknown_one(tmp_path):
    cli = main(["train", "fit", "--config=vit_tiny_digits", "--trainer.fast_dev_run", "1", "--trainer.accelerator",
                "cpu", "--model.model_overrides", TINY, "--trainer.default_root_dir", str(tmp_path)])
    assert cli == 0
    assert re.search(r"--config 'vit_tiny_digit' is neither a file nor a recipe; the recipes are "
                     r".*vit_tiny_digits",
                     error_line_of(["train", "fit", "-c", "vit_tiny_digit"]))


def test_the_learning_rate_panel_draws_the_heads_rate_and_says_the_layers_are_decayed(tmp_path):
    """With layer decay, the most decayed group's LR is far below the head's: the panel draws the largest (the base)
    and says how many groups sit below it."""
    from vitkit.evaluation.plots import learning_rate_series

    rows = [{"step": "0", "lr-AdamW/pg1": "1e-6", "lr-AdamW/pg2": "1e-3", "lr-AdamW/pg3": "1e-3"},
            {"step": "1", "lr-AdamW/pg1": "2e-6", "lr-AdamW/pg2": "2e-3", "lr-AdamW/pg3": "2e-3"}]
    key, title = learning_rate_series(rows)
    assert key == "lr-AdamW/pg2" and title == "learning rate\n(the head's; 1 groups decayed below)"
    assert learning_rate_series([{"step": "0", "lr-SGD": "0.1"}]) == ("lr-SGD", "learning rate")


@pytest.mark.parametrize("score", ["val/top1", "val/mAP"])
def test_the_curves_keep_their_titles_whole_and_draw_the_probe(tmp_path, monkeypatch, score):
    """A small-data run's curves.png: ViT-S's 26 LR groups in a title that fits its figure, and the probe it started
    from drawn on the accuracy panel beside the score (top-1, or a multi-label run's mAP)."""
    import matplotlib.figure
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from vitkit.evaluation.plots import training_curves

    groups = [f"lr-AdamW/pg{i}" for i in range(1, 27)]
    rows = [{"step": "0", "val/probe_baseline": "0.86"}] + [
        {"step": str(s), "train/loss_step": "0.5", score: "0.9", **{g: str(1e-4 * 0.75 ** i) for i, g in
                                                                   enumerate(groups)}} for s in (5, 10)]
    keys = ["step", "train/loss_step", score, "val/probe_baseline", *groups]
    csv_file = tmp_path / "metrics.csv"
    csv_file.write_text(",".join(keys) + "\n" + "".join(",".join(r.get(k, "") for k in keys) + "\n" for r in rows))
    saved = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: saved.append(fig))
    training_curves(csv_file)
    fig = saved[0]
    renderer = FigureCanvasAgg(fig).get_renderer()
    width = fig.bbox.width
    for ax in fig.axes:
        box = ax.title.get_window_extent(renderer)
        assert 0 <= box.x0 and box.x1 <= width, (ax.get_title(), box, width)
    accuracy = next(ax for ax in fig.axes if ax.get_title() == "accuracy")
    drawn = {line.get_label(): line.get_ydata() for line in accuracy.get_lines()}
    assert set(drawn) == {score, "val/probe_baseline"} and list(drawn["val/probe_baseline"]) == [0.86, 0.86]


def test_the_reconstruction_title_names_the_sizes_that_differ_from_the_preset():
    from vitkit.cli.reconstruct import described as _described

    model = vitkit.create_model("vit_tiny_patch16_224", patch_size=4, img_size=32, depth=2)
    assert _described(model) == "vit_tiny_patch16_224, patch 4, 32 px, depth 2"
    assert _described(vitkit.create_model("vit_tiny_patch16_224")) == "vit_tiny_patch16_224"


def test_help_shows_whole_first_sentences(capsys):
    """jsonargparse titles a class's arguments with the first line of its docstring: each of vitkit.lit's classes
    opens with a whole sentence, and `vitkit evaluate --help` titles its data arguments itself, not with
    LightningDataModule's "The main advantage is:"."""
    import inspect

    import vitkit.lit as lit

    for name in lit.__all__:
        obj = getattr(lit, name)
        if inspect.isclass(obj) and obj.__module__.startswith("vitkit") and obj.__doc__:
            first = obj.__doc__.strip().splitlines()[0].rstrip()
            assert first.endswith((".", ")")), f"{name}: {first}"
    assert main(["evaluate", "--help"]) == 0
    out = capsys.readouterr().out
    assert "the data:" in out and "main advantage" not in out


def test_the_help_of_each_subcommand_imports_no_torch(tmp_path):
    """`vitkit X --help` answers from the parser alone (benchmarks/startup.py times it). Train and evaluate list a
    LightningCLI's arguments: their plain forms ship with vitkit, made with the libraries installed here; any other
    help of theirs needs Lightning the first time, and then comes from the cache."""
    from vitkit.cli import COMMANDS
    from vitkit.cli.help_cache import SHIPPED, made_with

    code = ("import runpy, sys\nsys.argv = ['vitkit', *sys.argv[1:]]\ntry:\n    runpy.run_module('vitkit.cli', "
            "run_name='__main__')\nexcept SystemExit as e:\n    assert e.code in (0, None), e.code\n"
            "print(sorted(m for m in ('torch', 'lightning') if m in sys.modules))")
    env = {**os.environ, "VITKIT_CACHE": str(tmp_path), "COLUMNS": "100"}

    def help_of(*argv: str) -> tuple[str, str]:
        done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                              timeout=120, env=env, cwd=tmp_path)
        assert done.returncode == 0, (argv, done.stdout[-300:], done.stderr)
        text, imported = done.stdout.rstrip().rsplit("\n", 1)
        return text, imported

    for name in COMMANDS:
        if name not in ("train", "evaluate"):
            assert help_of(name, "--help")[1] == "[]", name
    fit, imported = help_of("train", "fit", "--help")
    assert "--trainer.max_epochs" in fit
    assert imported == ("[]" if json.loads((SHIPPED / "made_with.json").read_text()) == made_with()
                        else "['lightning', 'torch']")
    first, imported = help_of("train", "fit", "--model.help", "vitkit.lit.ImageClassifier")
    assert imported == "['lightning', 'torch']" and "--model.adaptation" in first and "--model.recipe.lr" in first
    assert help_of("train", "fit", "--model.help", "vitkit.lit.ImageClassifier") == (first, "[]")


def test_the_shipped_helps_are_the_ones_the_parser_prints(monkeypatch):
    """``vitkit/cli/help-texts/`` holds the help of train's and evaluate's plain forms, made with the libraries
    ``made_with.json`` names; where those are installed, each is what the parser prints now (a changed argument or
    docstring needs ``python -m vitkit.cli.help_cache``). Elsewhere, or in a narrower terminal, none is shown."""
    from vitkit.cli.help_cache import SHIPPED, SHIPPED_FORMS, made_with, shipped

    code = ("import json\nfrom vitkit.cli.help_cache import SHIPPED_FORMS, render\n"
            "print(json.dumps([render([*f, '--help']) for f in SHIPPED_FORMS]))")
    monkeypatch.setenv("COLUMNS", "80")
    if json.loads((SHIPPED / "made_with.json").read_text()) != made_with():
        assert shipped(["train", "fit", "--help"]) is None
        return
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    for form, text in zip(SHIPPED_FORMS, json.loads(done.stdout), strict=True):
        assert shipped([*form, "--help"]) == shipped([*form, "-h"]) == text, \
            f"vitkit {' '.join(form)} --help has changed: `make help-texts` writes the shipped helps again"
    assert shipped(["train", "fit", "-c", "vit_tiny_digits", "--help"]) is None
    monkeypatch.setenv("COLUMNS", "60")
    assert shipped(["train", "fit", "--help"]) is None


def test_the_help_cache_key_holds_what_the_help_depends_on(tmp_path, monkeypatch):
    """A changed config file, terminal width or folder is a different help; the same command line is the same."""
    from vitkit.cli.help_cache import asks_for_help, key

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "100")
    config = tmp_path / "c.yaml"
    config.write_text("trainer:\n  max_epochs: 3\n")
    argv = ["train", "fit", "-c", str(config), "--help"]
    assert asks_for_help(argv) and asks_for_help(["evaluate", "--data.help", "DigitsDataModule"])
    assert not asks_for_help(["train", "fit", "-c", str(config)]) and not asks_for_help(["predict", "--help"])
    assert not asks_for_help(["train", "fit", "--data.root", "notes.help"])  # a value, not jsonargparse's --X.help
    assert asks_for_help(["train", "fit", "--model.help=vitkit.lit.ImageClassifier"])
    before = key(argv)
    assert key(argv) == before and key(["train", "fit", f"--config={config}", "--help"]) != before
    config.write_text("trainer:\n  max_epochs: 5\n")
    assert key(argv) != before
    changed = key(argv)
    monkeypatch.setenv("COLUMNS", "120")
    assert key(argv) != changed
    monkeypatch.setenv("COLUMNS", "100")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert key(argv) != changed




def test_the_help_cache_keeps_only_a_help_the_parser_printed_before_exiting(tmp_path, monkeypatch, capsys):
    from vitkit.cli.help_cache import cache_dir, show

    monkeypatch.setenv("VITKIT_CACHE", str(tmp_path))
    argv = ["train", "fit", "--model.help", "vitkit.lit.ImageClassifier"]  # not a shipped form
    assert show(argv, lambda: print("ran") or 0) == 0  # a command that ran and returned: not a help
    assert not list(cache_dir().glob("*.txt"))

    def helps():
        print("usage: ...")
        raise SystemExit(0)

    assert show(argv, helps) == 0
    assert [p.read_text() for p in cache_dir().glob("*.txt")] == ["usage: ...\n"]
    assert show(argv, lambda: 1 / 0) == 0  # answered from the cache, without running
    assert capsys.readouterr().out == "ran\nusage: ...\nusage: ...\n"
