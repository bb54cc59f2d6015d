"""SamplingParams: how to pick each next token and when to stop (vLLM's names and meanings)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from runlm.engine.types.errors import SamplingParamsError
from runlm.engine.types.structured_params import StructuredOutputsParams, coerce_structured_outputs
from runlm.engine.types.thinking_params import ThinkingParams

_MAX_INT = 2**31 - 1
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                     # 0 or -1: no limit
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # DRY ("don't repeat yourself", llama.cpp's names): a token that would extend a sequence already written
    # loses dry_multiplier * dry_base ** (length - dry_allowed_length) from its logit. It looks at the last
    # dry_penalty_last_n generated tokens (-1: all of them), never at the prompt. 0.0: off.
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    # llama.cpp's penalty window: repetition_penalty looks at the last penalty_last_n tokens of prompt and output
    # (-1: all of them, vLLM's; 0: none). Ollama's repeat_last_n.
    penalty_last_n: int = -1
    # more of llama.cpp's samplers (its names and meanings; each off at its default):
    typical_p: float = 1.0             # locally typical sampling: the tokens nearest the entropy, to this mass
    top_n_sigma: float = -1.0          # keep logits within n standard deviations of the largest (<= 0: off)
    xtc_probability: float = 0.0       # exclude top choices: with this chance, drop every token above
    xtc_threshold: float = 0.1         # the threshold but the least likely of them
    mirostat: int = 0                  # 1 or 2: target a surprise of mirostat_tau (replaces top-k/p, min-p...)
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | Mapping[str, Any] | None = None  # JSON schema, regex, choice...
    # what logprobs report (vLLM's logprobs_mode): the model's own distribution, or the one sampled from
    # (after bias, penalties, the grammar's mask and temperature)
    logprobs_mode: str = "raw_logprobs"
    # a reasoning model's thinking tags: a budget closes the thinking, a grammar starts after it
    thinking: ThinkingParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.structured_outputs is not None:
            self.structured_outputs = coerce_structured_outputs(self.structured_outputs)
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def stateful(self) -> bool:
        """Samplers whose draw is more than a function of the logits and one uniform (XTC's own coin, mirostat's
        running target): a speculative draft cannot be verified against them."""
        return not self.greedy and (self.mirostat > 0 or self.xtc_probability > 0.0)

    @property
    def reads_previous_tokens(self) -> bool:
        """Whether the logits a row is sampled from depend on the tokens before it (repetition, presence, frequency
        or DRY penalties): such a row's next draw must wait until its last token is known on the host."""
        return (self.repetition_penalty != 1.0 and self.penalty_last_n != 0) or bool(self.presence_penalty) \
            or bool(self.frequency_penalty) or self.dry_multiplier > 0.0

    def validate(self) -> None:
        def bad(param: str, message: str) -> None:
            raise SamplingParamsError(param, message)

        if not isinstance(self.n, int) or not 1 <= self.n <= 128:
            bad("n", f"must be an integer from 1 to 128, got {self.n!r}")
        if not 0.0 <= self.temperature <= 2.0:  # OpenAI's range; past 2 the distribution is noise
            bad("temperature", f"must be between 0 and 2, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", f"must be 0 or -1 (no limit) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                bad(name, f"must be between -2 and 2, got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            bad("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty}")
        if not 0.0 <= self.dry_multiplier <= 100.0:
            bad("dry_multiplier", f"must be between 0 and 100, got {self.dry_multiplier}")
        if not 1.0 <= self.dry_base <= 10.0:
            bad("dry_base", f"must be between 1 and 10, got {self.dry_base}")
        if not isinstance(self.dry_allowed_length, int) or not 1 <= self.dry_allowed_length <= 1000:
            bad("dry_allowed_length", f"must be an integer from 1 to 1000, got {self.dry_allowed_length!r}")
        if not isinstance(self.dry_penalty_last_n, int) or self.dry_penalty_last_n < -1:
            bad("dry_penalty_last_n", f"must be -1 (all generated tokens) or a non-negative integer, "
                                      f"got {self.dry_penalty_last_n!r}")
        if not isinstance(self.penalty_last_n, int) or self.penalty_last_n < -1:
            bad("penalty_last_n", f"must be -1 (all tokens) or a non-negative integer, got {self.penalty_last_n!r}")
        if not 0.0 < self.typical_p <= 1.0:
            bad("typical_p", f"must be in (0, 1], got {self.typical_p}")
        if not -1.0 <= self.top_n_sigma <= 100.0:
            bad("top_n_sigma", f"must be between -1 (off) and 100, got {self.top_n_sigma}")
        if not 0.0 <= self.xtc_probability <= 1.0:
            bad("xtc_probability", f"must be in [0, 1], got {self.xtc_probability}")
        if not 0.0 <= self.xtc_threshold <= 1.0:
            bad("xtc_threshold", f"must be in [0, 1], got {self.xtc_threshold}")
        if self.mirostat not in (0, 1, 2):
            bad("mirostat", f"must be 0 (off), 1 or 2, got {self.mirostat!r}")
        if not 0.0 < self.mirostat_tau <= 20.0:
            bad("mirostat_tau", f"must be in (0, 20], got {self.mirostat_tau}")
        if not 0.0 < self.mirostat_eta <= 1.0:
            bad("mirostat_eta", f"must be in (0, 1], got {self.mirostat_eta}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            bad("logprobs_mode", f"must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and -2**63 <= self.seed < 2**64):
            bad("seed", f"must be an integer, got {self.seed!r}")
        if self.max_tokens is not None and not (isinstance(self.max_tokens, int) and 1 <= self.max_tokens <= _MAX_INT):
            bad("max_tokens", f"must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", f"must be a non-negative integer, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, int) and 0 <= v <= 20):
                bad(name, f"must be an integer from 0 to 20, got {v!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative token ids")
        if self.logit_bias is not None:
            for tok, bias in self.logit_bias.items():
                if not isinstance(tok, int) or tok < 0 or not -100.0 <= float(bias) <= 100.0:
                    bad("logit_bias", f"entries map token ids to values in [-100, 100], got {tok!r}: {bias!r}")
        if self.allowed_token_ids is not None and (
                not self.allowed_token_ids or any(not isinstance(t, int) or t < 0 for t in self.allowed_token_ids)):
            bad("allowed_token_ids", "must be a non-empty list of token ids")

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids must exist in the model's vocabulary."""
        th = self.thinking
        thinking_ids = [*th.end_ids, *th.start_ids, *th.close_ids] if th is not None else []
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("allowed_token_ids", self.allowed_token_ids or []),
                          ("logit_bias", list(self.logit_bias or {})), ("thinking_token_budget", thinking_ids)):
            out = [t for t in ids if t >= vocab_size]
            if out:
                raise SamplingParamsError(name, f"token id {out[0]} is outside the vocabulary (size {vocab_size})")
