from __future__ import annotations

from runlm.runner.metrics import label_samples


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

