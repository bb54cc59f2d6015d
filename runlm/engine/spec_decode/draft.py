"""Draft-model proposals: a second, smaller model of the same vocabulary guesses k tokens, one forward pass
per token, batched over the speculating sequences.

The draft keeps its own K/V tensors but addresses them through the target's block tables (the same
slots), so a sequence's blocks hold both models' K/V and preemption, release and rollback need nothing
of their own. ``spec.draft_computed`` says how many positions hold valid draft K/V: a pass first catches
up on the tokens the draft has not seen (the tokens accepted last step, or the whole prompt), whose last
row gives the first draft token. Positions past the accepted ones are simply rewritten later.

Prompt work: a block whose tokens the draft has all computed is marked ``draft_valid`` (cleared when the block
is taken for new contents), so a sequence that finds such blocks in the prefix cache starts the draft after
them. What the draft still has to catch up on counts against the step's token budget: it gets what the
target's tokens left of ``max_num_batched_tokens``, the shortest catch-ups (decoding sequences) first.

The draft runs on the native runner where it can (numpy K/V, runlm.engine.spec_decode.draft_native; no torch
in the process), else on torch (draft_torch), whichever runner the target is on.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

from runlm.engine.core.kv_cache import RELEASED, BlockManager
from runlm.engine.core.kv_groups import AnyBlockManager, HybridBlockManager
from runlm.engine.core.sequence import Sequence
from runlm.engine.runners.native import native_model
from runlm.engine.runners.threads import set_native_threads, set_torch_threads
from runlm.engine.sample.sampler import draw, probabilities
from runlm.engine.types.config import EngineConfig, dtype_itemsize
from runlm.kv_size import kv_cache_bytes_per_token
from runlm.models.native import NativeLoaded
from runlm.models.spec import read_spec

if TYPE_CHECKING:
    from runlm.models.load import LoadedModel

# (sequence, its tokens to compute, the first one's position)
Chunk = tuple[Sequence, list[int], int]


class DraftRunner(Protocol):
    """Runs the draft model over its own K/V (the target's block tables' slots)."""
    @property
    def kv_caches(self) -> list: ...  # type: ignore[type-arg]
    def allocate_kv_cache(self) -> None: ...
    def free_kv_cache(self) -> None: ...
    def rebind(self, loaded: LoadedModel | NativeLoaded) -> None: ...
    def last_logits(self, items: list[Chunk]) -> np.ndarray: ...


def load_draft(config: EngineConfig, path: str, target: LoadedModel | NativeLoaded, threads: int | None = None
               ) -> LoadedModel | NativeLoaded:
    """The draft model (native where it can run natively, else torch's; its runner's ``threads`` set where given),
    refused up front unless its vocabulary is the target's."""
    spec = read_spec(path, find_projector=False)
    draft: LoadedModel | NativeLoaded | None = native_model(spec, config)
    if draft is None:
        from runlm.models.load import load_decoder

        draft = load_decoder(spec, dtype=config.dtype, device=config.device, exact_numerics=config.exact_numerics)
    if threads is not None:
        (set_native_threads if isinstance(draft, NativeLoaded) else set_torch_threads)(threads)
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"speculative_config: the draft model's vocabulary ({draft.config.vocab_size} tokens) is "
                         f"not the target's ({target.config.vocab_size} tokens); a draft must share the target's "
                         f"tokenizer")
    return draft


def configured_draft(config: EngineConfig, target: LoadedModel | NativeLoaded, threads: int
                     ) -> LoadedModel | NativeLoaded | None:
    """The draft model that config.speculative_config names (method "draft_model"), else None."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return None
    assert spec.model is not None  # SpeculativeConfig checks it
    return load_draft(config, spec.model, target, threads)


def draft_kv_bytes_per_token(draft: LoadedModel | NativeLoaded | None, config: EngineConfig) -> int:
    """What the draft's K/V adds to each token's blocks (they hold both models'): the budget pays for both."""
    if draft is None:
        return 0
    c = draft.config
    dtype = config.kv_cache_dtype if isinstance(draft, NativeLoaded) else "auto"  # a native draft: the target's kind
    heads, k_dim, v_dim = c.kv_cache_shape
    return kv_cache_bytes_per_token(c.num_layers, heads, k_dim, dtype, dtype_itemsize(config.dtype), v_dim)


class DraftModelProposer:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | NativeLoaded, blocks: AnyBlockManager) -> None:
        self.loaded, self.blocks = loaded, blocks
        # its own K/V tensors over the shared block tables (a cache in groups: the global group's, which holds
        # every block of a sequence)
        main: BlockManager = blocks.main if isinstance(blocks, HybridBlockManager) else blocks
        self.main = main
        self.native = isinstance(loaded, NativeLoaded)
        self.runner: DraftRunner
        if isinstance(loaded, NativeLoaded):
            from runlm.engine.spec_decode.draft_native import NativeDraftRunner

            self.runner = NativeDraftRunner(config, loaded, main)
        else:
            from runlm.engine.spec_decode.draft_torch import TorchDraftRunner

            self.runner = TorchDraftRunner(config, loaded, main)
        self.max_chunk = config.max_num_batched_tokens  # catching up on a prompt goes at most this many a step
        self.max_position = loaded.config.max_position_embeddings
        self.num_catch_up_tokens = 0  # tokens of known text the draft has computed (its share of prompt work)

    def allocate_kv_cache(self) -> None:
        self.runner.allocate_kv_cache()

    def free_kv_cache(self) -> None:
        self.runner.free_kv_cache()

    def release_weights(self) -> None:
        self.loaded.model.release_weights()

    def reload_weights(self, config: EngineConfig) -> None:
        self.loaded.model = load_draft(config, str(self.loaded.path), self.loaded).model  # type: ignore[assignment]
        self.runner.rebind(self.loaded)

    def _cached_prefix(self, seq: Sequence, start: int) -> int:
        """Where the draft may start: past ``start``, over the blocks holding the draft's K/V for all their tokens
        (found in the prefix cache, or computed earlier by this sequence)."""
        table, size = seq.table, self.main.block_size
        i = start // size
        while i < len(table.blocks) and table.blocks[i] != RELEASED and self.main.blocks[table.blocks[i]].draft_valid:
            i += 1
        return max(start, i * size)

    def _mark_valid(self, seq: Sequence, start: int, end: int) -> None:
        """The blocks that positions start..end-1 (the sequence's own tokens) complete hold the draft's K/V too."""
        size, ids = self.main.block_size, seq.table.blocks
        for i in range(start // size, min(end // size, len(ids))):
            if ids[i] != RELEASED:
                self.main.blocks[ids[i]].draft_valid = True

    def propose(self, seqs: list[Sequence], ks: list[int], budget: int | None = None) -> None:
        """Set each sequence's draft (up to its k tokens; none while it is still catching up). ``budget``: how many
        tokens of catching up the step has room for (None: max_num_batched_tokens)."""
        left = self.max_chunk if budget is None else budget
        starts = [min(self._cached_prefix(s, s.spec.draft_computed), s.num_tokens - 1) for s in seqs]
        order = sorted(range(len(seqs)), key=lambda i: seqs[i].num_tokens - starts[i])  # shortest catch-up first
        todo: list[tuple[Sequence, int, int, int]] = []  # (seq, start, end, k)
        for i in order:
            seq, k, start = seqs[i], ks[i], starts[i]
            n = seq.num_tokens
            end = min(n, start + self.max_chunk, start + left)
            if end <= start:
                continue  # no room left this step: no draft
            k = min(k, self.max_position - n) if end == n else 0
            # the draft writes K/V for positions start .. end-1 (the newest token's slot may not exist yet), then
            # n .. n+k-2 for its own tokens: the table must reach them
            if not self.blocks.grow(seq.table, end + max(k - 1, 0)):
                k = min(k, 1)
                if not self.blocks.grow(seq.table, end):
                    continue  # the cache is full: no draft this step
            todo.append((seq, start, end, k))
            left -= end - start
        if not todo:
            return
        last = self._forward([(s, list(s.token_ids[a:b]), a) for s, a, b, _ in todo])
        for seq, start, end, _ in todo:
            seq.spec.draft_computed = end
            self.num_catch_up_tokens += end - start
            self._mark_valid(seq, start, end)
        drafting = [(seq, k) for seq, _, _, k in todo if k > 0]
        rows = [i for i, (_, _, _, k) in enumerate(todo) if k > 0]
        logits = last[rows] if rows else last[:0]
        drafts: list[list[int]] = [[] for _ in drafting]
        probs: list[list[np.ndarray]] = [[] for _ in drafting]
        step = 0
        while drafting and logits.shape[0]:
            active = [i for i, (_, k) in enumerate(drafting) if len(drafts[i]) < k]
            for row, i in enumerate(active):
                seq = drafting[i][0]
                if seq.params.greedy:
                    token = int(logits[row].argmax())
                else:
                    q = probabilities(logits[row], seq.params)
                    token = draw(q, seq.generator)
                    probs[i].append(q)
                drafts[i].append(token)
            step += 1
            feed = [i for i in active if len(drafts[i]) < drafting[i][1]]
            if not feed:
                break
            n_of = {i: drafting[i][0].num_tokens for i in feed}
            logits = self._forward([(drafting[i][0], [drafts[i][-1]], n_of[i] + step - 1) for i in feed])
            for i in feed:
                drafting[i][0].spec.draft_computed = n_of[i] + step
        for i, (seq, _) in enumerate(drafting):
            seq.spec.tokens = drafts[i]
            seq.spec.probs = np.stack(probs[i]) if probs[i] else None

    def _forward(self, items: list[Chunk]) -> np.ndarray:
        """Run (seq, tokens, first position) chunks through the draft; the float32 logits of each chunk's last row."""
        return self.runner.last_logits(items)
