"""The OpenAPI description ``vitkit serve`` answers at ``/openapi.json``: what ``POST /predict`` takes (a multipart
upload, raw image bytes, JSON with base64; one image or several; ``?format=overlay`` for a segmenter) and answers."""

from __future__ import annotations

ERROR = {"description": "one line of what is wrong", "content": {"application/json": {"schema": {
    "type": "object", "properties": {"detail": {"type": "string"}}, "required": ["detail"]}}}}


def description(about: dict) -> dict:
    """The OpenAPI 3.1 document of a server of ``about["task"]``'s model ``about["model"]``."""
    image = {"type": "string", "contentEncoding": "base64", "description": "an image file (JPEG, PNG, WebP, ...)"}
    label = {"type": "object", "properties": {"label": {"type": "string"}, "probability": {"type": "number"}}}
    prediction = {"type": "object", "description": "a classifier: `top` (its top-k; a multi-label classifier also "
                  "`labels`, those at or above their thresholds); a segmenter: `size`, `classes` (each class's share "
                  "of the pixels) and `mask_png` (a palette PNG of class indices, base64)",
                  "properties": {"top": {"type": "array", "items": label}, "labels": {"type": "array", "items": label},
                                 "size": {"type": "array", "items": {"type": "integer"}},
                                 "classes": {"type": "array", "items": {"type": "object"}},
                                 "mask_png": {"type": "string", "contentEncoding": "base64"}}}
    refusals = {str(code): ERROR for code in (400, 401, 413, 415)}
    return {
        "openapi": "3.1.0",
        "info": {"title": f"vitkit serve: {about.get('model')}", "version": about.get("version", "1"),
                 "description": f"A {about.get('task')} model, served by vitkit on LitServe."},
        "paths": {
            "/predict": {"post": {
                "summary": "What the model says of one image or several",
                "parameters": [{"name": "format", "in": "query", "required": False,
                                "schema": {"enum": ["json", "overlay"]},
                                "description": "overlay: a segmenter's mask over the image, as image/png"}],
                "requestBody": {"required": True, "content": {
                    "multipart/form-data": {"schema": {"type": "object", "properties": {
                        "file": {"type": "array", "items": {"type": "string", "format": "binary"}}}}},
                    "image/*": {"schema": {"type": "string", "format": "binary"}},
                    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
                    "application/json": {"schema": {"oneOf": [
                        {"type": "object", "properties": {"image": image}, "required": ["image"]},
                        {"type": "object", "properties": {"images": {"type": "array", "items": image}},
                         "required": ["images"]}]}}}},
                "responses": {"200": {"description": "one prediction per image, in order, and the server's time",
                                      "content": {"application/json": {"schema": {"type": "object", "properties": {
                                          "predictions": {"type": "array", "items": prediction},
                                          "ms": {"type": "number"}}}},
                                          "image/png": {"schema": {"type": "string", "format": "binary"}}}},
                              **refusals}}},
            "/health": {"get": {"summary": "ok once the model is loaded and warmed up (no API key needed)",
                                "responses": {"200": {"description": "ready"}, "503": {"description": "a worker is "
                                                                                                      "not ready"}}}},
            "/metrics": {"get": {"summary": "request counts and latency histograms, Prometheus' text format",
                                 "responses": {"200": {"description": "the metrics"}}}},
            "/info": {"get": {"summary": "the model file's name and task (model) and LitServe's settings (server)",
                              "responses": {"200": {"description": "JSON"}}}},
            "/": {"get": {"summary": "a page to try the model in a browser",
                          "responses": {"200": {"description": "HTML"}}}},
        },
        "components": {"securitySchemes": {"key": {"type": "apiKey", "in": "header", "name": "X-API-Key"}}},
    }
