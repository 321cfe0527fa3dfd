"""Helpers for test servers on 127.0.0.1: a free TCP port (the GCS emulator, a JAX
coordinator) and an HTTP handler base that does not log each request."""

from __future__ import annotations

import http.server

from pipeline.net import free_port

__all__ = ["QuietHandler", "free_port"]


class QuietHandler(http.server.BaseHTTPRequestHandler):
    """BaseHTTPRequestHandler without its per-request stderr lines (clean pytest output)."""

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the stdlib's name
        """Drop the message."""
