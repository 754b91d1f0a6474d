"""Pretrained weights by name, offline-first: timm's tags through the Hugging Face cache, torchvision's
weights through torch hub's cache.

    vit_base_patch16_224.augreg2_in21k_ft_in1k   timm tag -> hub repo timm/<name>, HF_HUB_CACHE
    swin_tiny_patch4_window7_224                 the preset's default tag (timm's first)
    ViT_B_16_Weights.IMAGENET1K_V1               torchvision weights -> $TORCH_HOME/hub/checkpoints
    hf-hub:timm/vit_small_patch16_224.augreg_in1k   any hub repo with a timm config.json

timm's pretrained configs are the one source of the repo, file, mean/std, crop_pct, interpolation,
input size, class count and label set. A file already in its cache is used with no call out; a missing
one is downloaded unless ``HF_HUB_OFFLINE`` is set or the host cannot be reached, in which case
:class:`MissingWeightsError` names the repo, the cache folder and the command that fetches them.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from vitkit.errors import MissingFileError, UsageError

from ..models.registry import find

log = logging.getLogger(__name__)

HF_FILES = ("model.safetensors", "pytorch_model.bin")  # what a timm hub repo holds, safest first
TV_WEIGHTS = re.compile(r"^(\w+)_Weights\.(\w+)$")  # ViT_B_16_Weights.IMAGENET1K_V1

# torchvision builder -> the vitkit preset of the same architecture
TORCHVISION_MODELS: dict[str, str] = {
    "vit_b_16": "vit_base_patch16_224", "vit_b_32": "vit_base_patch32_224", "vit_l_16": "vit_large_patch16_224",
    "vit_l_32": "vit_large_patch32_224", "vit_h_14": "vit_huge_patch14_224",
    "swin_t": "swin_tiny_patch4_window7_224", "swin_s": "swin_small_patch4_window7_224",
    "swin_b": "swin_base_patch4_window7_224",
}


class MissingWeightsError(MissingFileError):
    """Pretrained weights that are not in the local cache and cannot be downloaded from here."""


@dataclass
class Pretrained:
    """Where the weights of one pretrained name live, and the config they were trained with."""

    name: str  # as asked for
    preset: str  # the vitkit preset they fit
    config: dict[str, Any]  # config fields of the weights: img_size, num_classes, mean, std, crop_pct, interpolation
    pretrained_cfg: dict[str, Any]  # timm's layout, set on the model as ``model.pretrained_cfg``
    label_names: list[str] | None = None
    repo_id: str | None = None  # Hugging Face hub
    revision: str | None = None
    filenames: tuple[str, ...] = HF_FILES  # tried in order; a folder-like repo also gets config.json
    url: str | None = None  # torch hub cache (torchvision, and timm tags hosted elsewhere)
    with_config: bool = False  # hf-hub: repos whose config.json describes the model
    unreadable: str | None = None  # why there is nothing vitkit can load (no hosted file, or one it does not read)

    # -- where the cache keeps it ---------------------------------------------------------------------

    def cache_dir(self) -> Path:
        if self.repo_id:
            from huggingface_hub import constants

            return Path(constants.HF_HUB_CACHE)
        import torch.hub

        return Path(torch.hub.get_dir()) / "checkpoints"

    def cached(self) -> Path | None:
        """The weight file (a hub snapshot folder when it carries config.json) if it is cached; no network."""
        if self.unreadable:
            return None
        if self.url and not self.repo_id:
            path = self.cache_dir() / _url_filename(self.url)
            return path if path.is_file() else None
        from huggingface_hub import try_to_load_from_cache

        if self.with_config:
            cfg = try_to_load_from_cache(self.repo_id, "config.json", cache_dir=self.cache_dir(),
                                         revision=self.revision)
            if not isinstance(cfg, str):
                return None
        for filename in self.filenames:
            path = try_to_load_from_cache(self.repo_id, filename, cache_dir=self.cache_dir(), revision=self.revision)
            if isinstance(path, str):  # else None (unknown) or a marker that the repo has no such file
                return Path(path).parent if self.with_config else Path(path)
        return None

    # -- fetching -------------------------------------------------------------------------------------

    def fetch(self) -> Path:
        """The cached file if there is one, else a download; never a network call for a cached file."""
        path = self.cached()
        return path if path is not None else self.download()

    def download(self) -> Path:
        """Fetch into the cache (after a quick check that a download can start at all)."""
        if self.unreadable:
            raise UsageError(self.unreadable)
        why = _why_offline(self.repo_id is not None, self.url)
        if why:
            raise self.missing(why)
        if self.repo_id:
            from huggingface_hub import hf_hub_download
            from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

            def get(filename: str) -> Path:
                return Path(hf_hub_download(self.repo_id, filename, revision=self.revision, cache_dir=self.cache_dir()))

            try:
                if self.with_config:
                    get("config.json")
                for filename in self.filenames:
                    try:
                        path = get(filename)
                    except EntryNotFoundError as e:
                        if isinstance(e, LocalEntryNotFoundError):  # the download failed, not a missing file
                            raise
                        continue  # the repo has no such file: try the next name
                    return path.parent if self.with_config else path
            except OSError as e:  # the hub client's HTTP, connection and not-found errors
                raise self.missing(f"the download failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})") \
                    from None
            raise self.missing(f"hub repo {self.repo_id} has none of {list(self.filenames)}")
        import torch.hub

        dst = self.cache_dir() / _url_filename(self.url)
        dst.parent.mkdir(parents=True, exist_ok=True)
        digest = torch.hub.HASH_REGEX.search(dst.name)  # torchvision names carry a sha256 prefix
        try:
            torch.hub.download_url_to_file(self.url, str(dst), digest.group(1) if digest else None, progress=True)
        except (OSError, RuntimeError) as e:  # urllib's errors; a hash mismatch (the partial file is removed)
            raise self.missing(f"the download failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})") \
                from None
        return dst

    def missing(self, why: str) -> MissingWeightsError:
        where = (f"  repo:  {self.repo_id} ({' or '.join(self.filenames)})\n"
                 f"  cache: {self.cache_dir()} (HF_HUB_CACHE)" if self.repo_id else
                 f"  url:   {self.url}\n  cache: {self.cache_dir()} (TORCH_HOME)")
        return MissingWeightsError(
            f"pretrained weights for {self.name!r} are not in the local cache, and {why}.\n{where}\n"
            f"On a machine with a network, fetch them with\n  vitkit download {self.name}\n"
            "and copy that cache folder here (or point the cache variable above at a copy).")


def _url_filename(url: str) -> str:
    return os.path.basename(urlparse(url).path)


def _why_offline(hf: bool, url: str | None) -> str | None:
    """Why a download cannot start, or None. Checked up front, so that no network fails fast instead of
    waiting out the hub client's retries."""
    from huggingface_hub import constants

    if constants.is_offline_mode():  # timm users' offline switch; it holds for torch hub downloads too
        return "HF_HUB_OFFLINE is set"
    return _unreachable(constants.ENDPOINT if hf else url)


def _unreachable(url: str, timeout: float = 5.0) -> str | None:
    """None if a TCP connection to the URL's host opens within ``timeout`` seconds, else why not."""
    parts = urlparse(url)
    host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    result: list[str | None] = ["timed out"]

    def probe() -> None:  # a thread, so that a name lookup that hangs cannot hold the caller
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            result[0] = None
        except OSError as e:
            result[0] = str(e) or type(e).__name__

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(timeout + 1)
    return None if result[0] is None else f"there is no network: cannot reach {host}:{port} ({result[0]})"


# -- names -> sources ---------------------------------------------------------------------------------

def split_tag(name: str) -> tuple[str, str | None]:
    """'vit_base_patch16_224.augreg_in1k' -> ('vit_base_patch16_224', 'augreg_in1k')."""
    preset, _, tag = name.partition(".")
    return preset, tag or None


def resolve(name: str, any_architecture: bool = False) -> Pretrained:
    """The source and config of pretrained ``name``: a timm tag (or a bare preset: its default tag),
    torchvision weights, or ``hf-hub:REPO``. With ``any_architecture`` a timm tag of a model vitkit has no preset
    for (a CNN teacher: ``regnety_160.deit_in1k``) resolves too, its ``preset`` empty."""
    if name.startswith("hf-hub:"):
        repo, _, revision = name[len("hf-hub:"):].partition("@")
        return Pretrained(name, "", {}, {"hf_hub_id": repo}, repo_id=repo, revision=revision or None,
                          with_config=True)
    if TV_WEIGHTS.match(name):
        return _torchvision(name)
    return _timm(name, any_architecture)


def default_pretrained_cfg(preset: str) -> dict[str, Any]:
    """timm's ``pretrained_cfg`` of a bare preset: that of its default tag when timm knows the architecture,
    else timm's defaults for one it does not."""
    from timm.models import PretrainedCfg, get_pretrained_cfg

    return (get_pretrained_cfg(preset) or PretrainedCfg(architecture=preset)).to_dict()


def _timm(name: str, any_architecture: bool = False) -> Pretrained:
    import timm
    from timm.models import get_pretrained_cfg

    preset, tag = split_tag(name)
    try:
        find(preset)  # a readable error for an unknown preset
        fits = preset
    except ValueError:
        if not (any_architecture and preset in timm.list_models()):
            raise
        fits = ""  # weights of a timm model vitkit does not build (a teacher)
    known = timm.list_pretrained(f"{preset}.*")
    try:
        cfg = get_pretrained_cfg(name)
    except RuntimeError:  # timm: an invalid tag for the architecture
        cfg = None
    if cfg is None or (tag is None and not known):
        tags = ", ".join(k.split(".", 1)[1] for k in known) or "none"
        raise UsageError(f"timm knows no pretrained weights {name!r}; the tags of {preset} are: {tags}")
    pcfg = cfg.to_dict()
    full = f"{preset}.{pcfg['tag']}" if pcfg.get("tag") else preset
    config = {"num_classes": pcfg["num_classes"], "img_size": tuple(pcfg["input_size"][1:])}
    config.update({k: pcfg[k] for k in ("mean", "std", "crop_pct", "interpolation")})
    repo = pcfg.get("hf_hub_id") or None
    repo, _, revision = (repo or "").partition("@")
    files = (pcfg["hf_hub_filename"],) if pcfg.get("hf_hub_filename") else HF_FILES
    url = pcfg.get("url") or None
    unreadable = None  # a weightless tag ('untrained') still builds the model with pretrained=False
    if not repo and not url:
        unreadable = f"{full}: timm has no weights for this tag (it describes the architecture only)"
    elif not repo and pcfg.get("custom_load"):
        unreadable = f"{full}: timm hosts these weights in a format vitkit does not read ({url})"
    return Pretrained(full, fits, config, pcfg, _timm_labels(pcfg), repo_id=repo or None,
                      revision=revision or None, filenames=files, url=url, unreadable=unreadable)


def _timm_labels(pcfg: dict) -> list[str] | None:
    """Class names of a timm tag: its own, else those of the ImageNet subset it was trained on."""
    if pcfg.get("label_names"):
        return list(pcfg["label_names"])
    from timm.data import infer_imagenet_subset

    subset = infer_imagenet_subset(pcfg)
    labels = _imagenet_labels(subset) if subset else None
    return list(labels) if labels and len(labels) == pcfg["num_classes"] else None


@functools.lru_cache(maxsize=8)
def _imagenet_labels(subset: str) -> tuple[str, ...]:
    from timm.data import ImageNetInfo

    return tuple(ImageNetInfo(subset).label_descriptions())


def _torchvision(name: str) -> Pretrained:
    from torchvision.models import get_weight

    try:
        weights = get_weight(name)
    except (ValueError, KeyError, AttributeError) as e:
        raise UsageError(f"torchvision has no weights {name!r} ({e})") from None
    builder = TV_WEIGHTS.match(name).group(1).lower()
    if builder not in TORCHVISION_MODELS:
        raise UsageError(f"{name}: vitkit has no counterpart of torchvision's {builder}; it reads the weights of "
                         f"{', '.join(TORCHVISION_MODELS)}")
    preset = TORCHVISION_MODELS[builder]
    t = weights.transforms()
    crop, resize = t.crop_size[0], t.resize_size[0]
    config = dict(img_size=(crop, crop), num_classes=len(weights.meta["categories"]), mean=tuple(t.mean),
                  std=tuple(t.std), crop_pct=crop / resize, interpolation=t.interpolation.value)
    full = f"{type(weights).__name__}.{weights.name}"  # DEFAULT -> the weights it stands for
    pcfg = {"url": weights.url, "architecture": preset, "tag": full, "input_size": (3, crop, crop),
            **{k: config[k] for k in ("mean", "std", "crop_pct", "interpolation", "num_classes")}}
    return Pretrained(full, preset, config, pcfg, list(weights.meta["categories"]), url=weights.url)
