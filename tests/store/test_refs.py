"""Refs under concurrency and name collisions (issue 15 #11)."""
from __future__ import annotations

import threading

import pytest

from runlm.store import ModelStore, NameConflictError


def test_concurrent_writes_of_one_ref_never_collide(store: ModelStore) -> None:
    store.pull("tinycoder")
    errors: list[BaseException] = []

    def tag() -> None:
        try:
            for _ in range(30):
                store.tag("tinycoder", "same:v1")
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)
    threads = [threading.Thread(target=tag) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert store.get("same:v1").id == store.get("tinycoder").id
    assert not [p for p in (store.manifests / "same").iterdir() if p.name != "v1"]  # no temp file left


def test_a_name_that_is_also_a_folder_is_a_conflict_without_paths(store: ModelStore) -> None:
    store.pull("tinycoder", name="a:b")
    with pytest.raises(NameConflictError) as exc:
        store.tag("a:b", "a/b:c")
    assert str(store.home) not in str(exc.value)
    store.tag("a:b", "x/y:z")
    with pytest.raises(NameConflictError):
        store.tag("a:b", "x:y")
    with pytest.raises(LookupError):
        store.get("x:y")  # a folder of models is not a model
    assert {str(m.name) for m in store.list()} == {"a:b", "x/y:z"}
