"""LoRA adapters on the native decoder (csrc/lora_impl.h): each adapter's A and B matrices in the form the
native update reads, and each step's adapter per row.

An adapter is set per decoder projection (qkv, o, gate_up, down) as the torch model's fused Linear layers
hold it (runlm.models.lora): the A matrices of the adapted sub-projections stacked [rank, in], and per
sub-projection (a shard) its output columns and its B [hi - lo, r] with the adapter's scale folded in.
In fp32 (as on the torch fast path) the two compute the same bits; in fp16 (``half=True``) the matrices take
half the bytes a decode step streams, the products still fp32 on the fp16 values. The decoder keeps
pointers: the arrays are held here, per adapter key, until the adapter is dropped.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np

from runlm.native.decoder import Decoder
from runlm.native.library import F32, I64, arr, lib, ok

PROJECTIONS = {"qkv": 0, "o": 1, "gate_up": 2, "down": 3}

__all__ = ["PROJECTIONS", "Shard", "Update", "drop_adapter", "row_keys", "set_adapter", "set_rows"]


@dataclass(frozen=True, slots=True)
class Shard:
    lo: int  # output columns lo..hi of the projection
    hi: int
    b: np.ndarray  # fp32 [hi - lo, r], the scale folded in


@dataclass(frozen=True, slots=True)
class Update:
    """One layer projection's update: out[:, shard.lo:shard.hi] += (x A_s^T) B_s^T per shard."""
    layer: int
    projection: str  # a key of PROJECTIONS
    a: list[np.ndarray]  # each shard's A, fp32 [r, in]
    shards: list[Shard]


# decoder -> adapter key -> the arrays its native side reads
_HELD: weakref.WeakKeyDictionary[Decoder, dict[int, list[np.ndarray]]] = weakref.WeakKeyDictionary()


def set_adapter(decoder: Decoder, key: int, updates: list[Update], half: bool = False) -> None:
    """Give adapter ``key`` (a positive int, the engine's) these updates, stored as fp16 where ``half`` (else
    fp32); replaces any it had."""
    drop_adapter(decoder, key)
    held: list[np.ndarray] = []
    native, dtype = lib(), np.dtype(np.float16) if half else F32
    try:
        for u in updates:
            if u.projection not in PROJECTIONS or len(u.a) != len(u.shards) or not u.shards:
                raise ValueError(f"layer {u.layer}: a LoRA update needs one A per shard and a known projection "
                                 f"({sorted(PROJECTIONS)}), not {u.projection!r}")
            a = np.ascontiguousarray(np.concatenate(u.a) if len(u.a) > 1 else u.a[0], dtype=dtype)
            bounds, r = [], 0
            for part, s in zip(u.a, u.shards):
                if s.b.shape != (s.hi - s.lo, part.shape[0]):
                    raise ValueError(f"layer {u.layer} {u.projection}: B {s.b.shape} does not fit columns "
                                     f"{s.lo}..{s.hi} and rank {part.shape[0]}")
                bounds.append((s.lo, s.hi, r, r + part.shape[0]))
                r += part.shape[0]
            shards = np.asarray(bounds, dtype=np.int64)
            b = np.ascontiguousarray(np.concatenate([s.b.T.reshape(-1) for s in u.shards]), dtype=dtype)  # B^T
            held += [a, shards, b]
            ok(native.runlm_decoder_set_lora(decoder.handle, key, u.layer, PROJECTIONS[u.projection],
                                             arr(a, dtype, "A", 2), a.shape[0], a.shape[1], shards.shape[0],
                                             arr(shards, I64, "shards", 2), arr(b, dtype, "B", 1), int(half)))
    except Exception:
        native.runlm_decoder_drop_lora(decoder.handle, key)
        raise
    _HELD.setdefault(decoder, {})[key] = held


def drop_adapter(decoder: Decoder, key: int) -> None:
    lib().runlm_decoder_drop_lora(decoder.handle, key)
    _HELD.get(decoder, {}).pop(key, None)


def row_keys(keys: list[int], query_lens: list[int]) -> np.ndarray:
    """Each row's adapter key (int64 [T]) from each sequence's and its rows in the step."""
    return np.repeat(np.asarray(keys, dtype=np.int64), np.asarray(query_lens, dtype=np.int64))


def set_rows(decoder: Decoder, keys: np.ndarray | None) -> None:
    """The next steps' adapter per row (int64 [T], 0: none); None: no adapters."""
    if keys is None:
        ok(lib().runlm_decoder_set_lora_rows(decoder.handle, None, 0))
    else:
        ok(lib().runlm_decoder_set_lora_rows(decoder.handle, arr(keys, I64, "LoRA row keys", 1), keys.shape[0]))
