"""Tool calling: the tool prompt for chat templates, tool_choice as a grammar, and parsers that
turn a model's output into OpenAI ``tool_calls`` (whole or streamed). Pure functions over text."""
from __future__ import annotations
