from __future__ import annotations

import pytest

from runlm.runner.backends.flags import is_int, validate_flags
from runlm.runner.config import BackendConfig, BackendMode, ConfigError, parse_keep_alive


@pytest.mark.parametrize("value,seconds", [("5m", 300), ("1h30m", 5400), ("30s", 30), ("0", 0), (0, 0),
                                           ("-1", -1), (-5, -1), ("-1m", -1), ("250ms", 0.25), (120, 120),
                                           # issue 15 #9: past ten years is forever, not an unrepresentable time
                                           (1e20, -1), (float("inf"), -1), (float("-inf"), -1),
                                           ("99999999999h", -1)])
def test_keep_alive_durations(value: object, seconds: float) -> None:
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("bad", ["soon", "5 minutes", "m5", "", True, "1d", float("nan"), "Infinity", "NaN", "1e20"])
def test_bad_keep_alive_is_named(bad: object) -> None:
    with pytest.raises(ConfigError, match="keep_alive"):
        parse_keep_alive(bad)


def test_backend_config_accepts_dmr_and_snake_case() -> None:
    dmr = BackendConfig.from_json({"context-size": 2048, "runtime-flags": ["--threads", "2"], "keep_alive": "-1",
                                   "speculative": {"draft_model": "tinycoder", "num_tokens": 4},
                                   "llamacpp": {"reasoning-budget": 0},
                                   "vllm": {"gpu-memory-utilization": 0.5, "hf-overrides": {"a": 1}}})
    snake = BackendConfig.from_json({"context_size": 2048, "runtime_flags": ["--threads", "2"], "keep_alive": "-1",
                                     "speculative": {"draft_model": "tinycoder", "num_tokens": 4},
                                     "llamacpp": {"reasoning_budget": 0},
                                     "vllm": {"gpu_memory_utilization": 0.5, "hf_overrides": {"a": 1}}})
    assert dmr == snake
    assert dmr.keep_alive == -1 and dmr.speculative.num_tokens == 4 and dmr.gpu_memory_utilization == 0.5
    assert BackendConfig.from_json(dmr.to_json()) == dmr  # round trip


@pytest.mark.parametrize("body,field", [({"context-size": 4}, "context_size"),
                                         ({"context-size": "big"}, "context_size"),
                                         ({"runtime-flags": "--x"}, "runtime_flags"),
                                         ({"speculative": {"num_tokens": 3}}, "speculative"),
                                         ({"speculative": {"draft_model": "d", "num_tokens": 0}}, "num_tokens"),
                                         ({"vllm": {"gpu-memory-utilization": 1.5}}, "gpu_memory_utilization"),
                                         ({"llamacpp": {"reasoning-budget": -7}}, "reasoning_budget")])
def test_bad_config_names_the_field(body: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        BackendConfig.from_json(body)


def test_modes() -> None:
    assert BackendMode.parse("image-generation") is BackendMode.IMAGE_GENERATION
    with pytest.raises(ConfigError, match="completion, embedding, reranking"):
        BackendMode.parse("chat")


def test_flags_allow_list() -> None:
    allowed = {"--threads": is_int, "--flash-attn": None}
    assert validate_flags("x", allowed, ["--threads", "4", "--flash-attn", "--threads=2"]) == \
        ["--threads", "4", "--flash-attn", "--threads", "2"]
    for bad, why in ((["--model", "/etc/passwd"], "not allowed"), (["--threads", "; rm -rf /"], "valid value"),
                     (["--threads"], "valid value"), (["--flash-attn=1"], "takes no value")):
        with pytest.raises(ConfigError, match=why):
            validate_flags("x", allowed, bad)
