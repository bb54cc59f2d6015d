"""What both chats of ``runlm run`` share (in this process, or through a daemon): the options a person sets
(``--verbose``, ``--format json``, ``--think``, ``--hidethinking``), one turn's counts and times, and how the
thinking and the answer are printed (Ollama's "Thinking..." / "...done thinking." frame)."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import TextIO


@dataclass(slots=True)
class ChatOptions:
    verbose: bool = False
    format_json: bool = False
    think: bool | None = None        # None: the model's template decides
    hide_thinking: bool = False

    def template_kwargs(self) -> dict[str, bool]:
        return {} if self.think is None else {"enable_thinking": self.think}


@dataclass(slots=True)
class Turn:
    """One answer: its text, its thinking, and Ollama's counts and durations."""
    text: str = ""
    thinking: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    started: float = field(default_factory=time.monotonic)
    first: float | None = None
    ended: float | None = None

    def message(self) -> dict[str, str]:
        """The answer as the conversation keeps it (its thinking where the template may show it again)."""
        return {"role": "assistant", "content": self.text, **({"reasoning_content": self.thinking} if self.thinking
                                                               else {})}

    def stats(self) -> str:
        """Ollama's --verbose lines."""
        end = self.ended or time.monotonic()
        first = self.first or end
        prompt_s, eval_s = max(first - self.started, 1e-9), max(end - first, 1e-9)
        return "\n".join([
            f"total duration:       {_dur(end - self.started)}",
            f"prompt eval count:    {self.prompt_tokens} token(s)",
            f"prompt eval duration: {_dur(first - self.started)}",
            f"prompt eval rate:     {self.prompt_tokens / prompt_s:.2f} tokens/s",
            f"eval count:           {self.completion_tokens} token(s)",
            f"eval duration:        {_dur(end - first)}",
            f"eval rate:            {self.completion_tokens / eval_s:.2f} tokens/s"])


def _dur(seconds: float) -> str:
    return f"{seconds * 1000:.2f}ms" if seconds < 1 else f"{seconds:.3f}s"


class TurnPrinter:
    """Streams a turn's pieces: the thinking framed as Ollama frames it (or not at all under --hidethinking),
    then the answer."""

    def __init__(self, out: TextIO, turn: Turn, hide_thinking: bool) -> None:
        self.out, self.turn, self.hide = out, turn, hide_thinking
        self._thinking = False

    def push(self, thinking: str, text: str, tokens: int = 0) -> None:
        t = self.turn
        if (thinking or text or tokens) and t.first is None:
            t.first = time.monotonic()
        t.completion_tokens += tokens
        if thinking:
            t.thinking += thinking
            if not self.hide:
                if not self._thinking:
                    self.out.write("Thinking...\n")
                    self._thinking = True
                self.out.write(thinking)
        if text:
            self._close_thinking()
            t.text += text
            self.out.write(text)
        self.out.flush()

    def _close_thinking(self) -> None:
        if self._thinking:
            self.out.write("\n...done thinking.\n\n")
            self._thinking = False

    def finish(self, verbose: bool) -> Turn:
        self._close_thinking()
        self.turn.ended = time.monotonic()
        if verbose:
            print("\n" + self.turn.stats(), file=sys.stderr)
        return self.turn
