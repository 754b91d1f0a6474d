"""Bad input to every `vitkit` subcommand (arguments, files, config values, overrides, a trainer this machine cannot
run) ends with one ``error:`` line that names what was expected and what came, and exit status 1; ``--traceback``
shows the traceback instead."""

import os
from pathlib import Path

import lightning.pytorch  # noqa: F401 - imported before a test captures stderr: its log handler keeps the real stream
import numpy as np
import pytest
import torch
from PIL import Image

import vitkit
from tests import forkserver
from tests.commands import one_error_line, run_cli
from vitkit.cli import main

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(img_size=32, patch_size=8, depth=1, embed_dim=32, num_heads=2, num_classes=3)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_input")
    torch.manual_seed(0)
    model = vitkit.create_model("vit_tiny_patch16_224", **TINY)
    export = vitkit.save_pretrained(model, root / "export", ["a", "b", "c"])
    Image.fromarray(np.zeros((40, 40, 3), np.uint8)).save(root / "img.png")
    (root / "notes.png").write_text("a text file with an image's name\n")
    damaged = root / "damaged.pth"  # about 1% of its bytes changed, as a disk or a copy gone bad does
    torch.save(vitkit.create_model("vit_tiny_patch16_224", **TINY).state_dict(), damaged)
    data = bytearray(damaged.read_bytes())
    for i in range(60, len(data), 97):
        data[i] ^= 0x55
    damaged.write_bytes(bytes(data))
    return dict(export=str(export), img=str(root / "img.png"), damaged=str(damaged), root=root)


@pytest.mark.parametrize("argv, says", [
    (["predict", "{img}", "--model", "transformer_base"], "transformer_base"),
    (["predict", "{img}", "--checkpoint", "{export}", "--overrides", '{{"nope": 1}}'], "unknown config field"),
    (["predict", "{img}", "--checkpoint", "{export}", "--overrides", '{{"mlp_ratio": "x"}}'],
     "mlp_ratio must be a number, got 'x'"),
    (["predict", "{img}", "--checkpoint", "{export}", "--overrides", '{{"depth": 0}}'], "depth must be >= 1, got 0"),
    (["predict", "{img}", "--checkpoint", "{export}", "--overrides", '{{"depth": 1.5}}'], "depth must be an int"),
    (["predict", "{img}", "--checkpoint", "{export}", "--overrides", "notjson"], "expects a JSON object"),
    (["predict", "{img}", "--checkpoint", "{export}", "--overrides", "[1, 2]"], "got a JSON list"),
    (["predict", "{img}", "--checkpoint", "{damaged}", "--model", "vit_tiny_patch16_224"], "damaged.pth"),
    (["predict", "{img}", "--checkpoint", "{root}/missing.pth"], "does not exist"),
    (["predict", "{img}"], "give --checkpoint FILE"),
    (["predict", "{root}/missing.png", "--checkpoint", "{export}"], "cannot read image"),
    (["predict", "{root}/notes.png", "--checkpoint", "{export}"], "cannot read image '{root}/notes.png'"),
    (["predict", "{img}", "--onnx", "{damaged}"], "damaged.pth"),
    (["predict", "{img}", "--checkpoint", "{export}", "--topk", "x"], "invalid int value: 'x'"),
    (["predict", "{img}", "--checkpoint", "{export}", "--topk", "0"], "--topk expects a whole number of classes of 1"),
    (["export", "{export}", "-o", "{img}/x.onnx"], "img.png is a file, not a folder"),
    (["export", "{export}", "-o", "{root}/x.onnx", "--opset", "3"], "opset must be 18 or newer"),
    (["export", "no_such_model", "-o", "{root}/x.onnx"], "no_such_model"),
    (["convert", "{damaged}", "{root}/out", "--model", "vit_tiny_patch16_224"], "damaged.pth"),
    (["convert", "{export}", "{root}/out.txt"], "unknown destination"),
    (["convert", "{export}", "--overrides", '{{"embed_dim": "wide"}}', "-o", "{root}/o"], "embed_dim must be an int"),
    (["attention-map", "{img}", "--checkpoint", "{damaged}", "--model", "vit_tiny_patch16_224"], "damaged.pth"),
    (["pos-embed", "--model", "nope_model"], "nope_model"),
    (["prepare-data", "{root}/no_such_folder", "{root}/shards"], "no_such_folder"),
    (["prepare-data", "~no_such_user_here/x", "{root}/shards"], "~no_such_user_here/x' does not exist"),
    (["train", "fit", "-c", "vit_tiny_digits", "--data", "vitkit.lit.ImageFolderDataModule", "--data.root",
      "~no_such_user_here/x"], "ImageFolder root '~no_such_user_here/x' does not exist"),
    (["models", "--nope"], "unrecognized arguments: --nope"),
    (["no-such-command"], "invalid choice: 'no-such-command'"),
])
def test_each_subcommand_ends_bad_input_with_one_line(files, capsys, argv, says):
    line = one_error_line(*run_cli([a.format(**files) for a in argv], capsys))
    assert says.format(**files) in line and "error: error" not in line, line
    if argv[0] in ("predict", "export", "convert"):  # vitkit's own checks: the line starts with what it is
        assert line.startswith("error: "), line


def test_traceback_flag_shows_the_traceback(files, capsys):
    argv = ["predict", files["img"], "--checkpoint", files["export"], "--overrides", '{"mlp_ratio": "x"}']
    with pytest.raises(TypeError, match="mlp_ratio must be a number"):
        main([*argv, "--traceback"])
    os.environ.pop("VITKIT_TRACEBACK", None)
    assert run_cli(argv, capsys)[0] == 1


@pytest.mark.parametrize("extra, says", [
    (["--model.recipe.lr", "abc"], "--model.recipe.lr expects a float"),  # the flat flag, named as the part takes it
    (["--trainer.max_epochs=x"], "--trainer.max_epochs expects an int or null, got 'x'"),
    (["--nope", "1"], "unrecognized arguments"),
    (["--model.model_overrides", '{"depth": 0}'], "depth must be >= 1, got 0"),
    (["--model.model_overrides", '{"mlp_ratio": "x"}'], "mlp_ratio must be a number, got 'x'"),
    (["--data.batch_size", "2000"], "fewer than one batch of 2000"),
    (["--data", "vitkit.lit.ImageFolderDataModule", "--data.root", "{root}", "--data.color_jitter", "foo"],
     "color_jitter expects a number, 'auto' (by image size) or null (off), got 'foo'"),
])
def test_the_training_command_ends_bad_input_with_one_line(files, tmp_path, capfd, extra, says):
    folder = files["root"] / "folder"  # an image folder of two classes
    for split in ("train", "val"):
        for c in ("a", "b"):
            (folder / split / c).mkdir(parents=True, exist_ok=True)
            Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(folder / split / c / "x.png")
    argv = ["train", "fit", "-c", "vit_tiny_digits", "--trainer.default_root_dir", str(tmp_path),
            "--trainer.max_epochs", "1", *[a.replace("{root}", str(folder)) for a in extra]]
    status, err = run_cli(argv, capfd)
    line = one_error_line(status, err)
    assert says in line, line
    assert not list(tmp_path.iterdir()), "a refused run left files"  # no logs/ folder, no checkpoint
    assert "Total params" not in err  # refused before the model summary


def test_a_recipe_for_a_gpu_on_a_cpu_machine_names_the_flags_that_run_it_here(files, tmp_path):
    """From the shell, a GPU-only recipe (ImageNet's, on 8 GPUs) on a machine without one: one line naming what the
    recipe asks for, what the machine has, and the flags that run it here."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the recipe runs")
    data = tmp_path / "data"
    for split in ("train", "val"):
        for c in ("x", "y"):
            (data / split / c).mkdir(parents=True)
            Image.fromarray(np.zeros((40, 40, 3), np.uint8)).save(data / split / c / "0.png")
    out = forkserver.run(["-m", "vitkit.cli", "train", "fit", "--config", "vit_base_in1k", "--model.model_name",
                          "vit_tiny_patch16_224", "--model.pretrained", "false", "--model.checkpoint", files["export"],
                          "--data.root", str(data), "--trainer.default_root_dir", str(tmp_path / "run")],
                         cwd=tmp_path, env={**os.environ, "VITKIT_TRACEBACK": ""})
    line = one_error_line(out.returncode, out.stderr)
    assert "accelerator=gpu" in line and "0 CUDA GPU" in line, line
    assert "--trainer.accelerator cpu --trainer.devices 1 --trainer.precision 32-true" in line, line


def test_train_py_and_predict_of_several_images_take_the_same_path(files, capsys):
    """`python train.py` is `vitkit train` under another name: bad input ends it with the same one line. `predict`
    of several images says each unreadable one in its line and still answers for the others (exit status 1)."""
    out = forkserver.run([str(ROOT / "train.py"), "fit", "-c", "vit_tiny_digit"], cwd=files["root"], timeout=300)
    line = one_error_line(out.returncode, out.stderr)
    assert line.startswith("error: --config 'vit_tiny_digit' is neither a file nor a recipe"), line
    status = main(["predict", files["img"], f"{files['root']}/notes.png", files["img"], "--checkpoint",
                   files["export"]])
    out, err = capsys.readouterr()
    assert one_error_line(status, err).startswith(f"error: cannot read image '{files['root']}/notes.png'")
    assert [line.split(":")[0] for line in out.splitlines()] == [files["img"], files["img"]], out


def test_an_error_raised_in_a_loader_worker_is_its_own_line():
    """torch re-raises a worker's exception with the worker's traceback in its message: the line is the error's."""
    from torch.utils.data import DataLoader, Dataset

    from vitkit.errors import MissingFileError, error_line

    class Gone(Dataset):
        def __len__(self) -> int:
            return 2

        def __getitem__(self, i: int):
            raise MissingFileError(f"image val_{i:04d}.png is not there")

    with pytest.raises(MissingFileError) as caught:
        list(DataLoader(Gone(), num_workers=1))
    assert "Original Traceback" in str(caught.value)
    assert error_line(caught.value) == "error: image val_0000.png is not there"
