"""Helpers for test servers on 127.0.0.1: a free TCP port (the GCS emulator, a JAX
coordinator) and an HTTP handler base that does not log each request."""

from __future__ import annotations

import http.server
import socket


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class QuietHandler(http.server.BaseHTTPRequestHandler):
    """BaseHTTPRequestHandler without its per-request stderr lines (clean pytest output)."""

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the stdlib's name
        """Drop the message."""
