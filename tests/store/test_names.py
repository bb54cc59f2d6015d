from __future__ import annotations

import pytest

from runlm.store.names import InvalidNameError, ModelName, default_name_for


@pytest.mark.parametrize("text,name,tag", [
    ("smollm2", "smollm2", "latest"),
    ("SmolLM2:Q4", "smollm2", "q4"),
    ("org/repo:v1.2", "org/repo", "v1.2"),
    ("hf.co/HuggingFaceTB/SmolLM2-135M", "huggingfacetb/smollm2-135m", "latest"),
])
def test_names_parse_and_normalise(text: str, name: str, tag: str) -> None:
    parsed = ModelName.parse(text)
    assert (parsed.name, parsed.tag) == (name, tag)
    assert str(parsed) == f"{name}:{tag}"


@pytest.mark.parametrize("bad", ["", "../etc", "a/../../b", "/abs", "a//b", ".hidden", "a:b:c", "a:../x",
                                 "a b", "a/b/c/d/e", "x:", "name:.."])
def test_names_that_could_escape_or_are_malformed_are_refused(bad: str) -> None:
    with pytest.raises(InvalidNameError):
        ModelName.parse(bad)


def test_every_part_of_a_valid_name_is_a_plain_path_component() -> None:
    for text in ("a", "org/repo:tag", "x.y_z-1/q:v.2"):
        for part in ModelName.parse(text).parts:
            assert part not in (".", "..") and "/" not in part and part[0].isalnum() or part[0] == "_"


def test_default_names_from_files_and_repos() -> None:
    assert default_name_for("My Model.Q4_K_M.gguf") == "my-model.q4_k_m"
    assert default_name_for("HuggingFaceTB/SmolLM2-135M") == "huggingfacetb/smollm2-135m"
    ModelName.parse(default_name_for("??weird..name!!.gguf"))  # always valid
