"""A linear layer's weights as the native library holds them (a handle over the file's own blocks)."""
from __future__ import annotations

from ctypes import c_int64, c_void_p

import numpy as np

from runlm.formats.readahead import drop_mapped_pages
from runlm.native.library import U8, Handle, arr, lib, optional_f32, ptr


class LinearWeights(Handle):
    """A linear layer's weights for ``linear``: segments (raw uint8 [rows_i, row_bytes_i] arrays, each of
    ggml type types[i]) whose outputs are concatenated, ``cols`` inputs, an optional fp32 bias [rows].
    Holds the arrays alive; the native handle is freed by ``close()`` or when collected. Segments the library
    repacked (Q4_K, Q6_K: csrc/kquant_packed.h) are not read again: where they are a file's mapping, this process lets
    go of their pages (the page cache keeps them), so a packed weight is not held twice in its memory."""

    def __init__(self, segments: list[np.ndarray], types: list[int], cols: int, bias: np.ndarray | None = None) -> None:
        native = lib()
        if len(segments) != len(types) or not segments:
            raise ValueError("one type per weight segment, and at least one segment")
        for i, s in enumerate(segments):
            arr(s, U8, f"segment {i}", 2)
        self.rows, self.cols = sum(s.shape[0] for s in segments), int(cols)
        n = len(segments)
        data = (c_void_p * n)(*[ptr(s) for s in segments])
        rows = (c_int64 * n)(*[s.shape[0] for s in segments])
        widths = (c_int64 * n)(*[s.shape[1] for s in segments])
        kinds = (c_int64 * n)(*[int(t) for t in types])
        self._keep = (list(segments), bias)
        bias_p = optional_f32(bias, "bias", self.rows)
        super().__init__(native.runlm_linear_new(n, data, rows, widths, kinds, self.cols, bias_p), "runlm_linear_free",
                         "linear layer")
        drop_mapped_pages([s for i, s in enumerate(segments) if native.runlm_linear_packed(self.handle, i)])
