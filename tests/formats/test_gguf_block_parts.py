"""block_parts: the int8 values, scales and offsets of 32-value block types rebuild dequantize() bit for bit."""
from __future__ import annotations

import numpy as np
import pytest

from runlm.formats.gguf import GGUFFile, block_parts, dequantize
from tests.fixtures.models import smollm2_gguf
from tests.formats.test_gguf import random_blocks

BLOCK_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]


@pytest.mark.parametrize("qtype", BLOCK_TYPES)
def test_parts_rebuild_the_dequantized_values(qtype: str) -> None:
    rng = np.random.default_rng(sum(map(ord, qtype)))
    n, k = 6, 96
    raw = random_blocks(rng, qtype, n * k // 32)
    q, d, m = block_parts(raw, qtype, (n, k))
    assert q.dtype == np.int8 and d.shape == m.shape == (n, k // 32)
    rebuilt = (q.reshape(n, k // 32, 32) * d[:, :, None] + m[:, :, None]).reshape(n, k)
    expected = dequantize(raw, qtype, (n, k))
    np.testing.assert_array_equal(rebuilt, expected)  # +0.0 == -0.0, every other value bit-identical


def test_smollm2_tensors() -> None:
    g = GGUFFile(smollm2_gguf())
    q, d, m = g.load_block_parts("blk.0.ffn_down.weight")  # Q4_1
    assert q.shape == (576, 1536) and int(q.min()) >= 0 and int(q.max()) <= 15
    dense = g.load("blk.0.ffn_down.weight").numpy()
    rebuilt = q.numpy().reshape(576, 48, 32) * d.numpy()[:, :, None] + m.numpy()[:, :, None]
    np.testing.assert_array_equal(rebuilt.reshape(576, 1536), dense)
    assert g.load_block_parts("blk.0.attn_norm.weight") is None  # F32: no parts


def test_rejects_other_types_and_shapes() -> None:
    with pytest.raises(ValueError, match="block type"):
        block_parts(np.zeros(10, np.uint8), "Q6_K", (1, 256))
    with pytest.raises(ValueError, match="needs"):
        block_parts(np.zeros(10, np.uint8), "Q8_0", (1, 32))


def test_raw_array_is_the_mapped_bytes_and_raw_tensor_shares_them() -> None:
    g = GGUFFile(smollm2_gguf())
    arr = g.raw_array("blk.0.ffn_down.weight")  # Q4_1: 1536 values = 48 blocks of 20 bytes per row
    assert arr.dtype == np.uint8 and arr.shape == (576, 48 * 20) and not arr.flags.writeable
    assert np.shares_memory(arr, g.raw("blk.0.ffn_down.weight"))
    t = g.raw_tensor("blk.0.ffn_down.weight")
    assert tuple(t.shape) == arr.shape and t.data_ptr() == arr.ctypes.data
    np.testing.assert_array_equal(g.load_array("blk.0.ffn_down.weight"), g.load("blk.0.ffn_down.weight").numpy())
