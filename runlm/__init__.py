"""runlm: run language models locally and serve them."""
from __future__ import annotations

__version__ = "0.1.0"
