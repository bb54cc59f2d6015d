from __future__ import annotations

from runlm.runner.metrics import label_samples
from runlm.runner.ollama_convert import sampling_fields


def test_samples_get_model_labels_and_meta_is_not_repeated() -> None:
    text = ("# HELP req_total Requests.\n# TYPE req_total counter\nreq_total 3\n"
            'lat_bucket{le="0.5"} 1\n')
    seen: set[str] = set()
    a = label_samples(text, {"model": "a:latest", "backend": "native"}, seen)
    b = label_samples(text, {"model": 'b"x', "backend": "native"}, seen)
    assert 'req_total{model="a:latest",backend="native"} 3' in a
    assert 'lat_bucket{model="a:latest",backend="native",le="0.5"} 1' in a
    assert not any(line.startswith("#") for line in b)  # HELP/TYPE once per metric
    assert 'req_total{model="b\\"x",backend="native"} 3' in b


def test_ollama_options_and_format_translate_to_openai_fields() -> None:
    out = sampling_fields({"options": {"num_predict": 7, "temperature": 0.2, "repeat_penalty": 1.1, "num_ctx": 4096,
                                       "stop": ["\n"], "top_k": 5, "seed": 3}, "format": "json"})
    assert out == {"max_tokens": 7, "temperature": 0.2, "repetition_penalty": 1.1, "stop": ["\n"], "top_k": 5,
                   "seed": 3, "response_format": {"type": "json_object"}}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert sampling_fields({"format": schema})["response_format"]["json_schema"]["schema"] == schema
    assert "max_tokens" not in sampling_fields({"options": {"num_predict": -1}})
