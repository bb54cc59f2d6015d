"""Runtime flags for backend processes: only allow-listed flags with values of the right kind."""
from __future__ import annotations

import re
from collections.abc import Callable

from runlm.runner.config import ConfigError

FlagCheck = Callable[[str], bool] | None  # None: a switch without a value


def is_int(v: str) -> bool:
    return re.fullmatch(r"\d{1,9}", v) is not None


def is_float(v: str) -> bool:
    return re.fullmatch(r"\d{1,6}(\.\d{1,6})?", v) is not None


def is_size(v: str) -> bool:
    return re.fullmatch(r"\d+(\.\d+)?([kKmMgG][iI]?[bB]?)?", v) is not None


def validate_flags(backend: str, allowed: dict[str, FlagCheck], flags: list[str]) -> list[str]:
    """['--threads', '4', '--flash-attn'] -> the same list, or ConfigError naming the offending flag."""
    out: list[str] = []
    i = 0
    while i < len(flags):
        flag, _, inline = flags[i].partition("=")
        if flag not in allowed:
            raise ConfigError(f"runtime flag {flag!r} is not allowed for the {backend} backend "
                              f"(allowed: {', '.join(sorted(allowed)) or 'none'})")
        check = allowed[flag]
        if check is None:
            if inline:
                raise ConfigError(f"runtime flag {flag!r} takes no value")
            out.append(flag)
            i += 1
            continue
        value = inline if inline else (flags[i + 1] if i + 1 < len(flags) else None)
        if value is None or not check(value):
            raise ConfigError(f"runtime flag {flag!r} needs a valid value (got {value!r})")
        out += [flag, value]
        i += 1 if inline else 2
    return out
