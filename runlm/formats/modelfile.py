"""Ollama's Modelfile: ``FROM``, ``PARAMETER``, ``TEMPLATE``, ``SYSTEM``, ``MESSAGE``, ``ADAPTER``, ``LICENSE``
(and ``REQUIRES``), one instruction per line, case-insensitive, ``#`` comments; a value is the rest of its line,
a ``"quoted string"`` or a ``\"\"\"multi-line string\"\"\"``. What it says becomes a model's defaults
(runlm/store/modelfile_model.py); an instruction Ollama does not know is an error naming its line.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# a LoRA adapter's files: a PEFT directory's two, or one GGUF LoRA file (llama.cpp's convert_lora_to_gguf.py)
PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")
MAX_MODELFILE = 4 << 20   # bytes of Modelfile runlm reads (a long SYSTEM or MESSAGE history fits)
ROLES = ("system", "user", "assistant", "tool")
INSTRUCTIONS = ("from", "parameter", "template", "system", "message", "adapter", "license", "requires")


class ModelfileError(ValueError):
    pass


@dataclass(slots=True)
class Modelfile:
    base: str | None = None                                       # FROM: a model name, or a file or folder
    parameters: dict[str, Any] = field(default_factory=dict)      # Ollama option name -> value (stop: a list)
    template: str | None = None
    system: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)
    adapters: list[str] = field(default_factory=list)
    license: list[str] = field(default_factory=list)
    requires: str | None = None


@dataclass(frozen=True, slots=True)
class ChatDefaults:
    """What a model made from a Modelfile asks of every chat: a system prompt where the request has none, earlier
    messages before the request's, stop strings where the request gives none."""
    system: str | None = None
    messages: tuple[dict[str, str], ...] = ()
    stop: tuple[str, ...] = ()

    @classmethod
    def read(cls, path: Path | str) -> ChatDefaults:
        """The defaults file runlm/store/modelfile_model.py stores (JSON: system, messages, stop)."""
        from runlm.sizes import read_small_text

        data = json.loads(read_small_text(str(path), MAX_MODELFILE, "--model-defaults-file"))
        if not isinstance(data, dict):
            raise ValueError(f"{path}: not a JSON object")
        return cls(data.get("system"), tuple(data.get("messages") or ()), tuple(data.get("stop") or ()))

    def chat(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``messages`` as this model sends them to its template: the SYSTEM prompt first unless the request has
        a system message, then the MESSAGE history, then the request's own (Ollama's order)."""
        head: list[dict[str, Any]] = []
        if self.system and not any(m.get("role") in ("system", "developer") for m in messages):
            head.append({"role": "system", "content": self.system})
        return [*head, *(dict(m) for m in self.messages), *messages]


def is_adapter(names: set[str]) -> bool:
    """Whether file names are one LoRA adapter's: a PEFT directory's files, or one .gguf file."""
    return names == set(PEFT_FILES) or len(names) == 1 and next(iter(names)).endswith(".gguf")


def parameter_value(name: str, text: str) -> Any:
    """A PARAMETER's text as Ollama types it: integers, floats and booleans where they read as such."""
    if re.fullmatch(r"[-+]?\d+", text):
        return int(text)
    if re.fullmatch(r"[-+]?(\d+\.\d*|\.\d+|\d+)([eE][-+]?\d+)?", text):
        return float(text)
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return text


def _value(text: str, pos: int) -> tuple[str, int]:
    """The value starting at ``pos``: a triple-quoted block, a quoted string or the rest of the line."""
    def line_at(p: int) -> int:
        return text.count("\n", 0, p) + 1

    if text.startswith('"""', pos):
        end = text.find('"""', pos + 3)
        if end < 0:
            raise ModelfileError(f"Modelfile line {line_at(pos)}: unterminated \"\"\" string")
        return text[pos + 3:end], end + 3
    if text.startswith('"', pos):
        m = re.compile(r'"((?:[^"\\\n]|\\.)*)"').match(text, pos)
        if m is None:
            raise ModelfileError(f"Modelfile line {line_at(pos)}: unterminated quoted string")
        return re.sub(r'\\(["\\])', r"\1", m.group(1)), m.end()
    end = text.find("\n", pos)
    end = len(text) if end < 0 else end
    return text[pos:end].strip(), end


def parse_modelfile(text: str) -> Modelfile:
    """The Modelfile in ``text``; a ModelfileError names the line at fault."""
    if len(text) > MAX_MODELFILE:
        raise ModelfileError(f"the Modelfile is longer than {MAX_MODELFILE} bytes")
    text = text.replace("\r\n", "\n")
    out, pos = Modelfile(), 0
    while pos < len(text):
        line = text.count("\n", 0, pos) + 1
        m = re.compile(r"[ \t]*(?:(#[^\n]*)|(\S+)[ \t]*)?").match(text, pos)
        assert m is not None
        pos = m.end()
        if m.group(2) is None:
            pos = text.find("\n", pos) + 1 if "\n" in text[pos:] else len(text)
            continue
        word = m.group(2).lower()
        if word not in INSTRUCTIONS:
            raise ModelfileError(f"Modelfile line {line}: unknown instruction {m.group(2)!r}: each line starts with "
                                 f"one of {', '.join(i.upper() for i in INSTRUCTIONS)} (or # for a comment)")
        head = ""
        if word in ("parameter", "message"):
            h = re.compile(r"(\S+)[ \t]+").match(text, pos)
            if h is None:
                raise ModelfileError(f"Modelfile line {line}: {word.upper()} needs a name and a value")
            head, pos = h.group(1), h.end()
        value, pos = _value(text, pos)
        rest = text.find("\n", pos)
        trailing = text[pos:rest if rest >= 0 else len(text)].strip()
        if trailing and not trailing.startswith("#"):
            raise ModelfileError(f"Modelfile line {line}: unexpected {trailing[:40]!r} after the value")
        pos = rest + 1 if rest >= 0 else len(text)
        if not value and word not in ("system", "template"):
            raise ModelfileError(f"Modelfile line {line}: {word.upper()} needs a value")
        _apply(out, word, head, value, line)
    if out.base is None:
        raise ModelfileError("the Modelfile has no FROM line (FROM names the model it builds on)")
    return out


def _apply(out: Modelfile, word: str, head: str, value: str, line: int) -> None:
    if word == "from":
        out.base = value
    elif word == "parameter":
        name = head.lower()
        if name == "stop":
            out.parameters.setdefault("stop", []).append(value)
        else:
            out.parameters[name] = parameter_value(name, value)
    elif word == "template":
        out.template = value
    elif word == "system":
        out.system = value
    elif word == "message":
        role = head.lower()
        if role not in ROLES:
            raise ModelfileError(f"Modelfile line {line}: MESSAGE role {head!r} is not one of {', '.join(ROLES)}")
        out.messages.append({"role": role, "content": value})
    elif word == "adapter":
        out.adapters.append(value)
    elif word == "license":
        out.license.append(value)
    elif word == "requires":
        out.requires = value


def _quoted(text: str) -> str:
    return f'"""{text}"""' if "\n" in text or '"' in text or not text else text


def modelfile_text(name: str, parameters: dict[str, Any], template: str | None, system: str | None = None,
                   messages: list[dict[str, Any]] | None = None, license: list[str] | None = None) -> str:
    """What ``ollama show --modelfile`` prints for a model: FROM, a PARAMETER line per setting (Ollama's names),
    TEMPLATE, SYSTEM, one MESSAGE per message, LICENSE: a Modelfile that builds the same model again."""
    lines = [f"# Modelfile generated by runlm\nFROM {name}"]
    if template:
        lines.append(f'TEMPLATE """{template}"""')
    if system:
        lines.append(f"SYSTEM {_quoted(system)}")
    for key, value in parameters.items():
        for v in value if isinstance(value, list) else [value]:
            v = "true" if v is True else "false" if v is False else v
            lines.append(f"PARAMETER {key} {_quoted(v) if isinstance(v, str) else v}")
    for m in messages or []:
        lines.append(f"MESSAGE {m['role']} {_quoted(str(m.get('content', '')))}")
    for text in license or []:
        lines.append(f"LICENSE {_quoted(text)}")
    return "\n".join(lines) + "\n"
