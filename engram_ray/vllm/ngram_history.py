"""Per-request n-gram context inside vLLM's flattened batches, from a KV-slot-keyed history.

vLLM streams each request chunk by chunk (prefill chunks, then one token per decode step) and
flattens all scheduled requests into one `input_ids` / `positions` batch. The n-gram of the
token at position p needs the compressed ids at p-1 .. p-(N-1) of the same request, which may
have been scheduled in earlier steps.

Like vLLM 0.33's V1 path for DeepSeek-V4.1 (`NgramHashState.hash_cache`), the history is one
compressed id per KV-cache slot: the block table pins (request, position) to a physical slot,
so position q of request i is at `block_table[i, q // block_size] * block_size +
q % block_size`, where that request wrote its token when it processed q. Every step first
writes its own tokens, then reads lookbacks (in-batch ones included). Prefix caching must be
off (a cache hit would skip the writes) and the lookback depth (N-1) must stay far below the
number of slots a request holds (always true: a request holds its whole KV).
"""

from __future__ import annotations

import torch

from engram_ray.model.hashing import ngram_context


class NgramHistory:
    """Compressed id of the token last written to each KV slot; builds n-gram contexts."""

    def __init__(self, token_map: torch.Tensor, max_ngram_size: int, pad_id: int,
                 block_size: int):
        self.token_map = token_map.to(torch.int64)
        self.max_ngram_size, self.pad_id, self.block_size = max_ngram_size, pad_id, block_size
        self.slots = torch.full((0,), pad_id, dtype=torch.int64)

    def _ensure(self, num_slots: int) -> None:
        if num_slots > self.slots.shape[0]:
            grown = torch.full((max(num_slots, 2 * self.slots.shape[0]),), self.pad_id,
                               dtype=torch.int64)
            grown[:self.slots.shape[0]] = self.slots
            self.slots = grown

    def contexts(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 metadata) -> torch.Tensor:
        """`[num_tokens, max_ngram_size]` compressed ids (column k = k tokens back, pad before
        the request's start) for a flattened batch. `metadata`: vLLM attention metadata with
        `query_start_loc`, `block_table`, `slot_mapping`, `num_actual_tokens`; None (profile
        and dummy runs) treats the batch as one sequence and records nothing."""
        compressed = self.token_map[input_ids.to(torch.int64)]
        if metadata is None:
            return ngram_context(compressed, self.max_ngram_size, self.pad_id)
        num_tokens = int(metadata.num_actual_tokens)
        context = torch.full((input_ids.shape[0], self.max_ngram_size), self.pad_id,
                             dtype=torch.int64)
        context[:, 0] = compressed
        if num_tokens == 0:
            return context
        slots = metadata.slot_mapping[:num_tokens].to(torch.int64)
        block_table = metadata.block_table.to(torch.int64)
        query_ends = metadata.query_start_loc[1:].to(torch.int64)
        request_idx = torch.searchsorted(query_ends, torch.arange(num_tokens), right=True)
        pos = positions[:num_tokens].to(torch.int64)
        self._check_slots(block_table, request_idx, pos, slots)
        self._ensure(self.block_size * (int(block_table.max()) + 1))
        self.slots[slots] = compressed[:num_tokens]
        for back in range(1, self.max_ngram_size):
            q = pos - back
            safe_q = q.clamp(min=0)
            block = block_table[request_idx, safe_q // self.block_size]
            ids = self.slots[block * self.block_size + safe_q % self.block_size]
            context[:num_tokens, back] = torch.where(q >= 0, ids, self.pad_id)
        return context

    def _check_slots(self, block_table, request_idx, pos, slots) -> None:
        """The block-table arithmetic must reproduce vLLM's own slot of every current token."""
        block_idx = pos // self.block_size
        if int(block_idx.max()) < block_table.shape[1]:
            block = block_table[request_idx, block_idx]
            if torch.equal(block * self.block_size + pos % self.block_size, slots):
                return
        raise RuntimeError(
            f"n-gram history: slots from the block table (block size {self.block_size}) "
            "differ from vLLM's slot_mapping; expected the attention backend's block table "
            "to use the cache block size (run with the CPU attention backend, "
            "enable_prefix_caching=False)")
