"""EngineConfig.dtype: a name or a torch.dtype; names need no torch until a torch runner asks for one."""
from __future__ import annotations

import pytest
import torch

from runlm.dtypes import dtype_itemsize, torch_dtype
from runlm.engine.types.config import EngineConfig


def test_common_names_stay_names_and_convert() -> None:
    cfg = EngineConfig(model="m")
    assert cfg.dtype == "float32" and dtype_itemsize(cfg.dtype) == 4 and torch_dtype(cfg.dtype) is torch.float32
    assert dtype_itemsize("bfloat16") == 2 and torch_dtype("bfloat16") is torch.bfloat16


def test_torch_dtypes_and_rarer_names_are_torch_dtypes() -> None:
    assert EngineConfig(model="m", dtype=torch.float16).dtype is torch.float16
    cfg = EngineConfig(model="m", dtype="float64")
    assert cfg.dtype is torch.float64 and dtype_itemsize(cfg.dtype) == 8


@pytest.mark.parametrize("bad", ["bogus", "nn", 3])
def test_a_name_that_is_no_dtype_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="dtype must be"):
        EngineConfig(model="m", dtype=bad)  # type: ignore[arg-type]
