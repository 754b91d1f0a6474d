"""A real Hugging Face hub cache in a temporary folder, for tests of pretrained weights by name."""

from pathlib import Path

import torch
from huggingface_hub import constants
from safetensors.torch import save_file

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def write_hub_repo(cache: Path, repo_id: str, files: dict[str, Path]) -> Path:
    """The cache layout huggingface_hub reads: models--org--name/refs/main and snapshots/<commit>/<files>."""
    folder = cache / f"models--{repo_id.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / "main").write_text(COMMIT)
    snap = folder / "snapshots" / COMMIT
    snap.mkdir(parents=True, exist_ok=True)
    for name, src in files.items():
        (snap / name).write_bytes(src.read_bytes())
    return snap


def cache_weights(cache: Path, tag: str, model: torch.nn.Module, scratch: Path) -> Path:
    """``model``'s weights as timm's hub repo of ``tag`` (timm/<tag>/model.safetensors; some tags share the repo
    of another preset's tag, as the quickgelu CLIP towers do)."""
    from timm.models import get_pretrained_cfg

    path = scratch / "model.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)
    return write_hub_repo(cache, get_pretrained_cfg(tag).hf_hub_id or f"timm/{tag}", {"model.safetensors": path})


def use_offline_cache(monkeypatch, cache: Path) -> None:
    """Point huggingface_hub (and so timm and vitkit) at ``cache``, offline."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


class FakeHub:
    """A local HTTP server that answers as the Hugging Face hub does for file downloads
    (``HEAD``/``GET /<repo>/resolve/<revision>/<file>``), so that a download can be tested with no network."""

    def __init__(self, files: dict[tuple[str, str], bytes]) -> None:
        import hashlib
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.requests: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, body: bool) -> None:
                hub.requests.append(f"{self.command} {self.path}")
                repo, sep, rest = self.path.lstrip("/").partition("/resolve/")
                filename = rest.partition("/")[2]
                data = files.get((repo, filename)) if sep else None
                if data is None:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)

            def do_HEAD(self) -> None:  # noqa: N802 (http.server's naming)
                self._answer(body=False)

            def do_GET(self) -> None:  # noqa: N802
                self._answer(body=True)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "FakeHub":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
