"""Q4_K and Q6_K weights repacked at load (csrc/kquant_packed.h): the same bits as the rows as stored on every path, and the
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


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [64, 61])  # whole panels of 8, and a last panel padded with zero rows
def test_packed_rows_give_the_bits_of_the_rows_as_stored(rows: int, qtype: T) -> None:
    raw = _q(rows, qtype, 0)
    x = torch.randn(37, K, generator=torch.Generator().manual_seed(1)).numpy()
    ref = ggml.linear(torch.from_numpy(x), [torch.from_numpy(raw)], [qtype]).numpy()  # a plan made per call: unpacked
    w = nk.LinearWeights([raw], [qtype], K)
    assert nk.lib().runlm_linear_packed(w.handle, 0) == 1
    for m in (1, 2, 5, 32, 37):  # decode rows, small batches, a whole chunk and a chunk with a rest
        assert np.array_equal(nk.linear(x[:m], w, np.empty((m, rows), np.float32)), ref[:m])


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs /proc/self/smaps")
def test_a_packed_weight_lets_go_of_its_file_pages_and_nothing_else(tmp_path: Path) -> None:
    q4, q8 = _q(512, T.Q4_K, 2), _q(512, T.Q8_0, 3)
    m4, m8 = _mapped(tmp_path / "q4.bin", q4), _mapped(tmp_path / "q8.bin", q8)
    assert np.array_equal(m4, q4) and np.array_equal(m8, q8)  # every page read: mapped into this process
    before4, before8 = _resident_kb(m4), _resident_kb(m8)
    assert before4 >= q4.nbytes // 1024 - 8
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(4)).numpy()
    w4, w8 = nk.LinearWeights([m4], [T.Q4_K], K), nk.LinearWeights([m8], [T.Q8_0], K)
    assert _resident_kb(m4) <= 8  # the packed weight's pages are let go of (but the partial pages at its ends)
    assert _resident_kb(m8) == before8  # the Q8_0 weight is read as stored: its pages stay
    ref = ggml.linear(torch.from_numpy(x), [torch.from_numpy(q4)], [T.Q4_K]).numpy()
    assert np.array_equal(nk.linear(x, w4, np.empty((3, 512), np.float32)), ref)
    assert np.array_equal(m4, q4)  # the file's bytes are still there, read back from the page cache
    anonymous = q4.copy()  # memory that is no file's: never advised (MADV_DONTNEED would zero it)
    w_anon = nk.LinearWeights([anonymous], [T.Q4_K], K)
    assert np.array_equal(anonymous, q4)
    assert np.array_equal(nk.linear(x, w_anon, np.empty((3, 512), np.float32)), ref)
    w4.close(), w8.close(), w_anon.close()
