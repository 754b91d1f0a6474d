"""Pretrained weights by name, offline-first: a real Hugging Face cache and a real torch hub cache are
written in a temporary folder from randomly initialised timm / torchvision models; vitkit and the library
that wrote them read the same cache and must give the same logits, with no network call."""

import os
import re
import socket
import subprocess
from pathlib import Path

import pytest
import timm
import torch
import torchvision
from huggingface_hub import constants
from safetensors.torch import save_file
from torch.testing import assert_close

import vitkit
from vitkit.checkpoints import hub
from vitkit.checkpoints.adapt import classifier_names
from vitkit.checkpoints.formats import to_vitkit
from vitkit.checkpoints.hub import MissingWeightsError
from vitkit.models.config import pair

from .. import forkserver
from ..commands import error_line_of
from ..hub_cache import FakeHub, cache_weights, use_offline_cache, write_hub_repo
from ..inits import timm_shapes_model
from ..test_checkpoints import _randomize

VIT_TAG = "vit_tiny_patch16_224.augreg_in21k_ft_in1k"
SWIN_TAG = "swin_tiny_patch4_window7_224.ms_in1k"
DEIT_DISTILLED_TAG = "deit_tiny_distilled_patch16_224.fb_in1k"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache, offline (for timm too: both read huggingface_hub's settings)."""
    cache = tmp_path / "hf"
    cache.mkdir()
    use_offline_cache(monkeypatch, cache)
    return cache


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a connection fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"a network call was made: {args}")
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)


def _cache_timm_weights(cache: Path, tag: str, tmp_path: Path) -> torch.nn.Module:
    classes = timm.models.get_pretrained_cfg(tag).num_classes
    model = _randomize(timm.create_model(tag.split(".")[0], pretrained=False, num_classes=classes))
    cache_weights(cache, tag, model, tmp_path)
    return model


@pytest.mark.parametrize("tag", [VIT_TAG, SWIN_TAG, DEIT_DISTILLED_TAG])
def test_timm_tag_from_the_hub_cache_gives_timms_logits_with_no_network_call(tag, hf_cache, tmp_path, monkeypatch,
                                                                             no_network):
    _cache_timm_weights(hf_cache, tag, tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # offline-first: a cached file needs no network
    ours = vitkit.create_model(tag, pretrained=True)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    theirs = timm.create_model(tag, pretrained=True).eval()
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_close(ours.eval()(x), theirs(x), atol=1e-4, rtol=0)
    assert ours.load_report.ok
    cfg = theirs.pretrained_cfg
    for k in ("mean", "std", "crop_pct", "interpolation", "num_classes", "input_size", "hf_hub_id"):
        assert tuple(ours.pretrained_cfg[k]) == tuple(cfg[k]) if isinstance(cfg[k], tuple) else \
            ours.pretrained_cfg[k] == cfg[k], k
    assert (ours.cfg.mean, ours.cfg.crop_pct) == (tuple(cfg["mean"]), cfg["crop_pct"])
    assert len(ours.class_names) == 1000 and ours.class_names[0].startswith("tench")


def test_fine_tune_from_a_tag_matches_timm_at_a_new_size_and_head(hf_cache, tmp_path):
    _cache_timm_weights(hf_cache, VIT_TAG, tmp_path)
    ours = vitkit.create_model(VIT_TAG, pretrained=True, num_classes=10, img_size=96).eval()
    theirs = timm.create_model(VIT_TAG, pretrained=True, num_classes=10, img_size=96).eval()
    x = torch.randn(2, 3, 96, 96, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_close(ours.forward_features(x), theirs.forward_features(x), atol=1e-4, rtol=0)
    assert ours(x).shape == (2, 10) and ours.class_names is None  # a new head: the 1000 labels do not apply
    assert ours.cfg.mean == (0.5, 0.5, 0.5)  # the tag's preprocessing is kept


def test_a_tag_whose_hosted_weights_are_headless_fine_tunes_with_a_new_head(hf_cache, tmp_path):
    """DINOv2's tags are hosted without a head (num_classes=0 in timm's config): alone they give timm's
    features; with num_classes a new head is made and the backbone loads strictly."""
    tag = "vit_small_patch14_dinov2.lvd142m"
    assert timm.models.get_pretrained_cfg(tag).num_classes == 0
    small = dict(depth=1)  # the tag's full width and grid, one block
    model = _randomize(timm.create_model(tag.split(".")[0], pretrained=False, num_classes=0, **small))
    cache_weights(hf_cache, tag, model, tmp_path)
    ours = vitkit.create_model(tag, pretrained=True, **small).eval()
    theirs = timm.create_model(tag, pretrained=True, **small).eval()
    x = torch.randn(1, 3, 518, 518, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_close(ours(x), theirs(x), atol=1e-4, rtol=0)
    tuned = vitkit.create_model(tag, pretrained=True, num_classes=7, img_size=224, **small).eval()
    assert tuned.load_report.ok and "head: new (not in the checkpoint)" in tuned.load_report.adapted
    assert tuned(x[..., :224, :224]).shape == (1, 7)


# the backbones people fine-tune: image towers of image-text models, OpenAI's CLIP (pre-norm, QuickGELU, its 512-d
# projection as the head) and SigLIP 2 (no class token, the attention-pool head, no classifier); DINOv3 (2-D RoPE,
# storage tokens, LayerScale, timm's Eva names in the file; the _qkvb weights with q and v biases); NAVER's RoPE ViT
# (axial RoPE, interleaved); Swin V2 (cosine attention, the continuous position bias, post-norm)
TOWER_TAGS = ["vit_base_patch32_clip_quickgelu_224.openai", "vit_base_patch16_siglip_224.v2_webli",
              "vit_small_patch16_dinov3_qkvb.lvd1689m", "vit_small_patch16_rope_224.naver_in1k",
              "vit_small_patch16_rope_mixed_224.naver_in1k", "eva02_tiny_patch14_336.mim_in22k_ft_in1k",
              "swinv2_tiny_window8_256.ms_in1k"]  # EVA-02 B/L and EVA-CLIP's parts: every preset at depth one


@pytest.mark.slow
@pytest.mark.parametrize("tag", TOWER_TAGS)
def test_backbone_tags_give_timms_output_at_full_size_and_fine_tune_like_timm(tag, hf_cache, tmp_path):
    _cache_timm_weights(hf_cache, tag, tmp_path)
    ours = vitkit.create_model(tag, pretrained=True).eval()
    theirs = timm.create_model(tag, pretrained=True).eval()
    x = torch.randn(2, *theirs.pretrained_cfg["input_size"], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out, ref = ours(x), theirs(x)
    assert out.shape == ref.shape == (2, theirs.pretrained_cfg["num_classes"] or theirs.num_features)
    assert (out - ref).abs().max() <= 1e-4 * ref.abs().max()  # within 1e-4 of the output's scale
    assert ours.load_report.ok and ours.cfg.mean == tuple(theirs.pretrained_cfg["mean"])
    # fine-tuning: a new head at a new resolution (whole Swin windows: vitkit masks padded keys, timm does not);
    # the backbone's weights (the attention pool's too) load
    ours = vitkit.create_model(tag, pretrained=True, num_classes=10, img_size=128).eval()
    theirs = timm.create_model(tag, pretrained=True, num_classes=10, img_size=128).eval()
    x = x[..., :128, :128]
    with torch.no_grad():
        assert_close(ours.forward_head(ours.forward_features(x), pre_logits=True),
                     theirs.forward_head(theirs.forward_features(x), pre_logits=True), atol=1e-4, rtol=1e-4)
    assert ours(x).shape == (2, 10) and ours.load_report.ok
    head = classifier_names(ours)
    assert ours.load_report.new_head == [f"{head}.bias", f"{head}.weight"]


@pytest.mark.slow
def test_torchvision_weights_from_torch_hub_cache_give_torchvisions_logits(tmp_path, monkeypatch, hf_cache,
                                                                           no_network):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    weights = torchvision.models.Swin_T_Weights.IMAGENET1K_V1
    model = _randomize(torchvision.models.swin_t())
    cached = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(weights.url)
    cached.parent.mkdir(parents=True)
    torch.save(model.state_dict(), cached)
    ours = vitkit.create_model("Swin_T_Weights.IMAGENET1K_V1", pretrained=True).eval()
    theirs = torchvision.models.swin_t(weights=weights).eval()  # reads the same cached file
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_close(ours(x), theirs(x), atol=1e-4, rtol=0)
    assert ours.class_names == weights.meta["categories"]
    assert ours.cfg.crop_pct == pytest.approx(224 / 232) and ours.cfg.interpolation == "bicubic"
    assert vitkit.create_model("Swin_T_Weights.DEFAULT", pretrained=True).pretrained_cfg["tag"] == \
        "Swin_T_Weights.IMAGENET1K_V1"


@pytest.mark.parametrize("builder", sorted(hub.TORCHVISION_MODELS))
def test_every_torchvision_weights_fits_its_vitkit_preset(builder):
    """For every weights enum of every mapped torchvision model, the file torchvision would write (its
    state dict shapes, on the meta device) loads into the vitkit model the weights name builds."""
    for weights in torchvision.models.get_model_weights(builder):
        name = f"{type(weights).__name__}.{weights.name}"
        cfg = vitkit.get_config(name)
        with torch.device("meta"):
            kw = {"image_size": pair(cfg.img_size)[0]} if builder.startswith("vit") else {}
            theirs = torchvision.models.get_model(builder, **kw)
            ours = vitkit.create_model(name)
        sd, fmt = to_vitkit(theirs.state_dict())
        assert fmt.startswith("torchvision"), name
        want = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
        assert {k: tuple(v.shape) for k, v in sd.items()} == want, name
        assert ours.cfg.num_classes == len(weights.meta["categories"]) == 1000


def _every_tag() -> list[str]:
    presets = [n for n in vitkit.list_models() if vitkit.family(n) != "seq2seq"]
    return [t for n in presets for t in timm.list_pretrained(f"{n}.*") if t.split(".")[0] == n]


@pytest.mark.slow
def test_every_timm_tag_of_every_preset_builds_the_shapes_of_timms_model():
    """Every pretrained tag timm knows for vitkit's presets resolves (repo or url, config, labels) and
    builds a model whose state dict has the keys and shapes of timm's model of that tag, so its weights load.
    Tags that share an architecture, class count and input size are compared with one timm model."""
    tags = _every_tag()
    assert len(tags) > 150
    timm_shapes = {}
    for tag in tags:
        src = hub.resolve(tag)
        # timm's repo of the tag (the quickgelu CLIP towers share the repo of the GELU preset's same tag), or a url
        hosted = src.repo_id is not None and src.repo_id.startswith("timm/") and src.repo_id.endswith(
            "." + tag.split(".", 1)[1])
        assert hosted or (src.url and not src.repo_id), tag
        pcfg = timm.models.get_pretrained_cfg(tag)
        key = (src.preset, pcfg.num_classes, tuple(pcfg.input_size))
        if key not in timm_shapes:
            theirs = timm_shapes_model(tag)
            timm_shapes[key] = {k: tuple(v.shape) for k, v in to_vitkit(theirs.state_dict())[0].items()}
        with torch.device("meta"):
            ours = vitkit.create_model(tag)
        assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == timm_shapes[key], tag
        assert ours.pretrained_cfg["input_size"] == tuple(pcfg.input_size), tag
        assert (ours.cfg.mean, ours.cfg.crop_pct) == (tuple(pcfg.mean), pcfg.crop_pct), tag


def test_missing_weights_offline_name_the_repo_the_cache_and_the_command(hf_cache, no_network):
    with pytest.raises(MissingWeightsError) as e:
        vitkit.create_model(VIT_TAG, pretrained=True)
    msg = str(e.value)
    assert f"timm/{VIT_TAG}" in msg and str(hf_cache) in msg and f"vitkit download {VIT_TAG}" in msg
    assert "HF_HUB_OFFLINE" in msg


def test_missing_weights_without_a_network_fail_fast_and_clearly(hf_cache, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with socket.socket() as s:  # a port nobody listens on: the connection is refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(MissingWeightsError, match=f"cannot reach 127.0.0.1:{port}") as e:
        vitkit.create_model(SWIN_TAG, pretrained=True)
    assert f"vitkit download {SWIN_TAG}" in str(e.value)


def test_missing_torchvision_weights_name_the_url_and_torch_home(tmp_path, monkeypatch, hf_cache, no_network):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    with pytest.raises(MissingWeightsError) as e:
        vitkit.create_model("ViT_B_16_Weights.IMAGENET1K_V1", pretrained=True)
    msg = str(e.value)
    assert "vit_b_16-c867db91.pth" in msg and str(tmp_path / "torch") in msg and "TORCH_HOME" in msg


def test_unknown_tags_and_weights_are_named_with_what_exists():
    with pytest.raises(ValueError, match="augreg_in21k_ft_in1k"):
        vitkit.create_model("vit_tiny_patch16_224.no_such_tag", pretrained=True)
    with pytest.raises(ValueError, match="vit_b_16"):
        vitkit.create_model("MaxVit_T_Weights.IMAGENET1K_V1", pretrained=True)
    with pytest.raises(ValueError, match="unknown model"):
        vitkit.create_model("vit_tiny_patch99_224.augreg_in1k", pretrained=True)


def test_local_dir_plain_path_and_hf_hub_repo(tmp_path, hf_cache, no_network):
    net = _randomize(vitkit.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=3))
    folder = vitkit.save_pretrained(net, tmp_path / "export", class_names=["a", "b", "c"])
    x = torch.randn(1, 3, 32, 32)
    snap = write_hub_repo(hf_cache, "someone/tiny-vit", {"config.json": folder / "config.json",
                                                          "model.safetensors": folder / "model.safetensors"})
    for name in (f"local-dir:{folder}", str(folder), "hf-hub:someone/tiny-vit"):
        got = vitkit.create_model(name, pretrained=True).eval()
        with torch.no_grad():
            assert_close(got(x), net(x)), name
        assert got.class_names == ["a", "b", "c"], name
    assert snap.is_dir()
    fresh = vitkit.create_model(f"local-dir:{folder}")  # timm's semantics: the config, random weights
    assert fresh.cfg.img_size == 32 and not torch.equal(fresh.head.weight, net.head.weight)
    path_form = vitkit.create_model("vit_tiny_patch16_224", pretrained=str(folder / "model.safetensors"),
                                    img_size=32, patch_size=8, depth=2, num_classes=3).eval()
    with torch.no_grad():
        assert_close(path_form(x), net(x))


def _cli(*args: str, env: dict) -> subprocess.CompletedProcess:
    """``python -m vitkit.cli ARGS`` with the hub's settings in its environment: forked from an interpreter that
    imported torch alone, so that huggingface_hub reads them as it does in a user's shell."""
    return forkserver.run(["-m", "vitkit.cli", *args], env={**os.environ, **env}, cwd=env.get("CWD", str(REPO)),
                          timeout=240, preload="torch")


@pytest.mark.slow
def test_cli_predict_by_tag_prints_label_names_and_download_reports_the_cache(tmp_path):
    """From a shell, as a user would: HF_HUB_CACHE and HF_HUB_OFFLINE=1 in the environment."""
    from PIL import Image

    cache = tmp_path / "hf"
    _cache_timm_weights(cache, VIT_TAG, tmp_path)
    img = tmp_path / "img.png"
    Image.new("RGB", (256, 200), (200, 120, 40)).save(img)
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "CWD": str(tmp_path)}
    out = _cli("predict", str(img), "--model", VIT_TAG, "--topk", "3", env=env)
    assert out.returncode == 0, out.stderr
    names = vitkit.create_model(VIT_TAG).class_names
    assert out.stdout.startswith(f"{img}: ") and sum(n in out.stdout for n in names) >= 3
    out = _cli("download", VIT_TAG, SWIN_TAG, env=env)
    assert out.returncode == 1 and "already cached" in out.stdout and str(cache) in out.stdout
    assert f"timm/{SWIN_TAG}" in out.stderr and "HF_HUB_OFFLINE" in out.stderr and "Traceback" not in out.stderr


def test_cli_predict_refuses_a_clip_tower_whose_outputs_are_an_embedding(hf_cache, tmp_path):
    from PIL import Image


    tag = "vit_base_patch32_clip_quickgelu_224.openai"
    cache_weights(hf_cache, tag, _randomize(timm.create_model(tag.split(".")[0], num_classes=512, depth=1)), tmp_path)
    Image.new("RGB", (64, 64), (200, 120, 40)).save(tmp_path / "img.png")
    assert re.search(r"is CLIP's image tower: its 512 outputs are its image embedding .* Fine-tune "
                     r"it: `vitkit train fit -c vit_base_clip_finetune",
                     error_line_of(["predict", str(tmp_path / "img.png"), "--model", tag, "--overrides",
                                    '{"depth": 1}']))


def test_cli_predict_without_the_weights_says_how_to_get_them(hf_cache, tmp_path, no_network):

    assert re.search(f"vitkit download {SWIN_TAG}",
                     error_line_of(["predict", str(tmp_path / "img.png"), "--model", SWIN_TAG]))
    assert re.search("give --checkpoint FILE, --onnx FILE, or --model NAME",
                     error_line_of(["predict", str(tmp_path / "img.png")]))


@pytest.mark.slow
def test_download_fills_the_cache_then_loading_needs_no_network(hf_cache, tmp_path, monkeypatch):
    """`vitkit download`, from a shell, against a local server that answers as the hub does (HF_ENDPOINT, as
    for a hub mirror): the weights land in the standard cache layout, and then load with the server gone
    and the network refused. A repo with only pytorch_model.bin is fetched after model.safetensors is not found."""
    vit = _randomize(timm.create_model("vit_tiny_patch16_224"))
    swin = _randomize(timm.create_model("swin_tiny_patch4_window7_224"))
    save_file({k: v.contiguous() for k, v in vit.state_dict().items()}, tmp_path / "vit.safetensors")
    torch.save(swin.state_dict(), tmp_path / "swin.bin")
    files = {(f"timm/{VIT_TAG}", "model.safetensors"): (tmp_path / "vit.safetensors").read_bytes(),
             (f"timm/{SWIN_TAG}", "pytorch_model.bin"): (tmp_path / "swin.bin").read_bytes()}
    with FakeHub(files) as server:
        env = {"HF_ENDPOINT": server.url, "HF_HUB_CACHE": str(hf_cache), "HF_HUB_OFFLINE": "0", "CWD": str(tmp_path)}
        out = _cli("download", VIT_TAG, SWIN_TAG, env=env)
        assert out.returncode == 0, (out.stderr[-2000:], server.requests)
        assert out.stdout.count(": downloaded: ") == 2 and str(hf_cache) in out.stdout
        fetched = [r for r in server.requests if "/resolve/" in r]
        out = _cli("download", VIT_TAG, env=env)  # a second time: found in the cache, no request
        assert out.returncode == 0 and "already cached" in out.stdout
        assert [r for r in server.requests if "/resolve/" in r] == fetched
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: pytest.fail("network call"))
    x = torch.randn(1, 3, 224, 224)
    for tag, ref in ((VIT_TAG, vit), (SWIN_TAG, swin)):
        with torch.no_grad():
            assert_close(vitkit.create_model(tag, pretrained=True).eval()(x), ref(x), atol=1e-4, rtol=0)
