"""What stands in front of LitServe's app in ``vitkit serve``, as one ASGI middleware: the API key (every path but
``/health``), the body limit, the forms a ``POST /predict`` may take (a multipart upload, raw image bytes, or JSON
with base64, one image or several) put into the one JSON form the worker decodes, the page at ``/``, the OpenAPI
description and ``/metrics`` in Prometheus' text format. Every refusal is an HTTP 4xx with ``{"detail": "one line"}``,
as FastAPI's own errors are."""

from __future__ import annotations

import base64
import hmac
import json
import time
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)  # seconds, Prometheus' defaults
IMAGE_TYPES = ("image/", "application/octet-stream")


class Metrics:
    """Request counts and latency histograms by path, method and status, as Prometheus reads them."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str, int], int] = {}
        self.buckets: dict[tuple[str, str], list[int]] = {}
        self.sums: dict[tuple[str, str], float] = {}

    def observe(self, path: str, method: str, status: int, seconds: float) -> None:
        self.counts[(path, method, status)] = self.counts.get((path, method, status), 0) + 1
        counts = self.buckets.setdefault((path, method), [0] * (len(BUCKETS) + 1))
        for i, edge in enumerate((*BUCKETS, float("inf"))):
            if seconds <= edge:
                counts[i] += 1
        self.sums[(path, method)] = self.sums.get((path, method), 0.0) + seconds

    def text(self) -> str:
        lines = ["# HELP vitkit_requests_total HTTP requests, by path, method and status.",
                 "# TYPE vitkit_requests_total counter"]
        lines += [f'vitkit_requests_total{{path="{p}",method="{m}",status="{s}"}} {n}'
                  for (p, m, s), n in sorted(self.counts.items())]
        lines += ["# HELP vitkit_request_seconds Time from a request's arrival to its answer.",
                  "# TYPE vitkit_request_seconds histogram"]
        for (p, m), counts in sorted(self.buckets.items()):
            for edge, n in zip((*BUCKETS, "+Inf"), counts, strict=True):
                lines.append(f'vitkit_request_seconds_bucket{{path="{p}",method="{m}",le="{edge}"}} {n}')
            lines.append(f'vitkit_request_seconds_sum{{path="{p}",method="{m}"}} {self.sums[(p, m)]:.6f}')
            lines.append(f'vitkit_request_seconds_count{{path="{p}",method="{m}"}} {counts[-1]}')
        return "\n".join(lines) + "\n"


class Refused(Exception):
    """A request the gate answers itself, with ``status`` and one line."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


async def _answer(send: Callable, status: int, body: bytes, content_type: str,
                  headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class Gate:
    """The middleware (``LitServer(..., middlewares=[(Gate, {...})])``): ``api_key`` (None: none asked for),
    ``max_body`` bytes, ``max_images`` a request, and what the server's description says of the model (``about``: its
    task and name)."""

    def __init__(self, app: Callable[..., Awaitable[Any]], api_key: str | None, max_body: int, about: dict,
                 max_images: int = 64) -> None:
        self.app, self.api_key, self.max_body, self.about = app, api_key, max_body, about
        self.max_images = max_images
        self.metrics = Metrics()
        self.page = resources.files("vitkit.serving").joinpath("page.html").read_bytes()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, method, start, status = scope["path"], scope["method"], time.perf_counter(), [500]

        async def send_and_note(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self._route(scope, receive, send_and_note, path, method)
        except Refused as e:
            await _answer(send_and_note, e.status, json.dumps({"detail": e.detail}).encode(), "application/json")
        finally:
            known = path if path in ("/", "/predict", "/health", "/metrics", "/openapi.json", "/info") else "other"
            self.metrics.observe(known, method, status[0], time.perf_counter() - start)

    async def _route(self, scope: dict, receive: Callable, send: Callable, path: str, method: str) -> None:
        headers = {k.decode().lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if path != "/health" and self.api_key is not None:
            scheme, _, token = headers.get("authorization", "").strip().partition(" ")
            given = headers.get("x-api-key") or (token.strip() if scheme.lower() == "bearer" else "")
            if not given and method == "GET" and path == "/":  # the page in a browser: /?key=KEY
                from urllib.parse import parse_qs

                given = (parse_qs(scope.get("query_string", b"").decode()).get("key") or [""])[0]
            if not hmac.compare_digest(given.encode(), self.api_key.encode()):
                raise Refused(401, "this server asks for its API key: send it as the X-API-Key header (or "
                                   "Authorization: Bearer KEY)")
        if method == "GET" and path == "/":
            return await _answer(send, 200, self.page, "text/html; charset=utf-8")
        if method == "GET" and path == "/metrics":
            return await _answer(send, 200, self.metrics.text().encode(), "text/plain; version=0.0.4")
        if method == "GET" and path == "/openapi.json":
            from .openapi import description

            return await _answer(send, 200, json.dumps(description(self.about)).encode(), "application/json")
        if path == "/predict":
            if method != "POST":
                raise Refused(405, f"/predict takes POST, got {method}")
            body = json.dumps(await self._images(scope, receive, headers)).encode()
            scope = {**scope, "headers": [(b"content-type", b"application/json"),
                                          (b"content-length", str(len(body)).encode())]}
            sent = False

            async def receive_json() -> dict:
                nonlocal sent
                if sent:
                    return {"type": "http.disconnect"}
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}

            return await self.app(scope, receive_json, send)
        return await self.app(scope, receive, send)

    async def _body(self, receive: Callable, headers: dict) -> bytes:
        declared = headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > self.max_body:
            raise Refused(413, f"the request is {int(declared):,} bytes, above the server's --max-body-mb "
                               f"({self.max_body / 2**20:g} MiB)")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise Refused(400, "the client went away before the request's end")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                raise Refused(413, f"the request is above the server's --max-body-mb ({self.max_body / 2**20:g} "
                                   "MiB)")
            chunks.append(chunk)
            if not message.get("more_body"):
                return b"".join(chunks)

    def _counted(self, images: list) -> list:
        if len(images) > self.max_images:
            raise Refused(413, f"the request holds {len(images)} images; the server takes up to {self.max_images} "
                               "a request (--max-images)")
        return images

    async def _images(self, scope: dict, receive: Callable, headers: dict) -> dict:
        """The request's images as the worker takes them: ``{"images": [base64, ...], "format": ...}`` (the format
        from the query, or a form's ``format`` field, or a JSON body's)."""
        from urllib.parse import parse_qs

        kind = headers.get("content-type", "").split(";")[0].strip().lower()
        query = parse_qs(scope.get("query_string", b"").decode())
        fmt = (query.get("format") or [None])[0]
        if kind == "multipart/form-data":
            from starlette.requests import Request

            body = await self._body(receive, headers)
            replay = [{"type": "http.request", "body": body, "more_body": False}]

            async def again() -> dict:
                return replay.pop() if replay else {"type": "http.disconnect"}

            try:
                form = await Request(scope, again).form(max_files=self.max_images + 1,
                                                        max_fields=self.max_images + 1)
            except Exception as e:  # noqa: BLE001 - python-multipart's errors for a malformed body
                if "too many" in str(e).lower():
                    raise Refused(413, f"the request holds more than {self.max_images} images, the most the server "
                                       "takes a request (--max-images)") from None
                raise Refused(400, f"the multipart body does not parse: {e}") from None
            files = [await v.read() for _, v in form.multi_items() if hasattr(v, "read")]
            fmt = fmt or next((v for k, v in form.multi_items() if k == "format" and isinstance(v, str)), None)
            if not files:
                raise Refused(400, "the multipart request holds no file: send each image as a file field")
            return {"images": [base64.b64encode(f).decode() for f in self._counted(files)], "format": fmt}
        if kind.startswith(IMAGE_TYPES):
            return {"images": [base64.b64encode(await self._body(receive, headers)).decode()], "format": fmt}
        if kind == "application/json":
            try:
                payload = json.loads(await self._body(receive, headers) or b"null")
            except (ValueError, RecursionError) as e:
                raise Refused(400, f"the JSON body does not parse: {e}") from None
            images = payload.get("images", [payload.get("image")] if "image" in payload else None) \
                if isinstance(payload, dict) and not {"image", "images"} <= payload.keys() else None
            if not isinstance(images, list) or not images or not all(isinstance(x, str) for x in images):
                raise Refused(400, 'a JSON request is {"image": BASE64} or {"images": [BASE64, ...]}, one of the two')
            return {"images": self._counted(images), "format": payload.get("format", fmt)}
        raise Refused(415, f"/predict takes multipart/form-data, image/* or application/octet-stream bytes, or "
                           f"application/json with base64; got {kind or 'no content type'}")
