"""The OpenAI-compatible HTTP server over one engine (``runlm serve-engine MODEL``)."""
from __future__ import annotations

from runlm.server.app import build_app
from runlm.server.state import ServerSettings

__all__ = ["ServerSettings", "build_app"]
