"""Property tests of model names (issue 15, "make the classes impossible"): any text either parses to a name
whose files stay inside the store, and reads back as itself, or is an InvalidNameError; never anything else."""
from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from runlm.store import InvalidNameError, ModelName

# names as people and attackers type them: path pieces, dots, colons, case, unicode, separators
pieces = st.sampled_from(["a", "Z", "0", ".", "..", "/", ":", "-", "_", "~", "\\", " ", "\x00", "é", "hf.co/",
                          "latest", "%2e", "\n"])
texts = st.lists(pieces, max_size=12).map("".join) | st.text(max_size=40)


@settings(max_examples=2000, deadline=None)
@given(texts)
def test_a_name_parses_safely_or_is_refused(text: str) -> None:
    try:
        name = ModelName.parse(text)
    except InvalidNameError:
        return
    root = Path("/store/manifests")
    path = root.joinpath(*name.parts)
    assert path.resolve().is_relative_to(root) and ".." not in name.parts and "" not in name.parts
    assert all(p == p.lower() and "\\" not in p and "\x00" not in p for p in name.parts)
    assert ModelName.parse(str(name)) == name  # what we print reads back as the same name
