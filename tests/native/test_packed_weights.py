"""Q4_K weights repacked at load (csrc/kquant_packed.h): the same bits as the rows as stored on every path, and the
file pages a packed weight no longer reads are let go of, while memory that is not a file's mapping is left alone."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from runlm.kernels import ggml
from runlm.native import kernels as nk

pytestmark = pytest.mark.skipif(not (nk.available() and ggml.available()),
                                reason="the native kernels or the torch extensions are unavailable here")

K = 768  # three superblocks


def _q(rows: int, qtype: T, seed: int) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    return ggml.quantize(torch.randn(rows, K, generator=g), qtype).numpy()


def _resident_kb(array: np.ndarray) -> int:
    """Kilobytes of this process's resident pages in the mapping that holds ``array`` (/proc/self/smaps)."""
    address, current, rss = array.ctypes.data, False, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            current = lo <= address < hi
        elif current and head == "Rss:":
            rss = int(line.split()[1])
    return rss


def _mapped(path: Path, raw: np.ndarray) -> np.ndarray:
    raw.tofile(path)
    return np.memmap(path, mode="r").view(np.ndarray).reshape(raw.shape)


@pytest.mark.parametrize("rows", [64, 61])  # whole panels of 8, and a last panel padded with zero rows
def test_packed_rows_give_the_bits_of_the_rows_as_stored(rows: int) -> None:
    raw = _q(rows, T.Q4_K, 0)
    x = torch.randn(37, K, generator=torch.Generator().manual_seed(1)).numpy()
    ref = ggml.linear(torch.from_numpy(x), [torch.from_numpy(raw)], [T.Q4_K]).numpy()  # a plan made per call: unpacked
    w = nk.LinearWeights([raw], [T.Q4_K], K)
    assert nk.lib().runlm_linear_packed(w.handle, 0) == 1
    for m in (1, 2, 5, 32, 37):  # decode rows, small batches, a whole chunk and a chunk with a rest
        assert np.array_equal(nk.linear(x[:m], w, np.empty((m, rows), np.float32)), ref[:m])


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs /proc/self/smaps")
def test_a_packed_weight_lets_go_of_its_file_pages_and_nothing_else(tmp_path: Path) -> None:
    q4, q6 = _q(512, T.Q4_K, 2), _q(512, T.Q6_K, 3)
    m4, m6 = _mapped(tmp_path / "q4.bin", q4), _mapped(tmp_path / "q6.bin", q6)
    assert np.array_equal(m4, q4) and np.array_equal(m6, q6)  # every page read: mapped into this process
    before4, before6 = _resident_kb(m4), _resident_kb(m6)
    assert before4 >= q4.nbytes // 1024 - 8
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(4)).numpy()
    w4, w6 = nk.LinearWeights([m4], [T.Q4_K], K), nk.LinearWeights([m6], [T.Q6_K], K)
    assert _resident_kb(m4) <= 8  # the packed weight's pages are let go of (but the partial pages at its ends)
    assert _resident_kb(m6) == before6  # the Q6_K weight is read as stored: its pages stay
    ref = ggml.linear(torch.from_numpy(x), [torch.from_numpy(q4)], [T.Q4_K]).numpy()
    assert np.array_equal(nk.linear(x, w4, np.empty((3, 512), np.float32)), ref)
    assert np.array_equal(m4, q4)  # the file's bytes are still there, read back from the page cache
    anonymous = q4.copy()  # memory that is no file's: never advised (MADV_DONTNEED would zero it)
    w_anon = nk.LinearWeights([anonymous], [T.Q4_K], K)
    assert np.array_equal(anonymous, q4)
    assert np.array_equal(nk.linear(x, w_anon, np.empty((3, 512), np.float32)), ref)
    w4.close(), w6.close(), w_anon.close()
