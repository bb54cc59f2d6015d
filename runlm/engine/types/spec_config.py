"""speculative_config: what proposes draft tokens and how many (vLLM's names and JSON shape).

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    {"method": "draft_model", "model": "path/or/name", "num_speculative_tokens": 4}

``min_acceptance_rate`` (Docker Model Runner's name) is runlm's addition: a sequence whose recent
acceptance rate falls below it (or below what pays for its verification rows beside the step's other
sequences: runlm.engine.spec_decode.decoder.break_even_rate) stops speculating for a while, and a draft after a
mostly rejected one is shorter (runlm.engine.core.spec_state), so a poor draft costs little; 0 turns these off
(always k tokens).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 64
# below this recent acceptance a k-token draft verifies at a loss on CPU (verifying k+1 rows costs more than one)
DEFAULT_MIN_ACCEPTANCE_RATE = 0.1
DEFAULT_LOOKUP_MIN, DEFAULT_LOOKUP_MAX = 2, 4


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    model: str | None = None            # the draft model (a path once resolved), for method "draft_model"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = DEFAULT_LOOKUP_MIN
    prompt_lookup_max: int = DEFAULT_LOOKUP_MAX
    min_acceptance_rate: float = DEFAULT_MIN_ACCEPTANCE_RATE

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)}, not {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer from 1 to "
                             f"{MAX_SPECULATIVE_TOKENS}, got {k!r}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config: method 'draft_model' needs 'model' (the draft model)")
        if self.method == "ngram" and self.model:
            raise ValueError("speculative_config: method 'ngram' takes no 'model'")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi <= 64):
            raise ValueError(f"speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max <= 64, got "
                             f"{lo!r} and {hi!r}")
        r = self.min_acceptance_rate
        if isinstance(r, bool) or not isinstance(r, int | float) or not 0.0 <= r <= 1.0:
            raise ValueError(f"speculative_config.min_acceptance_rate must be between 0 and 1, got {r!r}")

    @classmethod
    def coerce(cls, value: SpeculativeConfig | Mapping[str, Any] | None) -> SpeculativeConfig | None:
        """A dict (as vLLM's --speculative-config JSON) -> the config; unknown keys are refused by name."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, Mapping):
            raise ValueError("speculative_config must be an object such as {\"method\": \"ngram\", "
                             "\"num_speculative_tokens\": 4}")
        data = {k: v for k, v in value.items() if v is not None}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        if "method" not in data:
            data["method"] = "draft_model" if data.get("model") else "ngram"
        # vLLM: one bound given alone stands for both
        if "prompt_lookup_max" in data and "prompt_lookup_min" not in data:
            data["prompt_lookup_min"] = min(data["prompt_lookup_max"], DEFAULT_LOOKUP_MIN)
        if "prompt_lookup_min" in data and "prompt_lookup_max" not in data:
            data["prompt_lookup_max"] = max(data["prompt_lookup_min"], DEFAULT_LOOKUP_MAX)
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}
