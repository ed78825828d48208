"""DeepSeek-V4.1 n-gram hashing in torch: token ids -> compressed ids -> table rows.

Matches vLLM 0.33 (`vllm/models/deepseek_v41/common/engram.py`: `build_compressed_token_map`,
`compute_hash_multipliers`, `_hash_ids_kernel`) bit for bit:

- compressed map: each token's text is decoded alone and normalized (NFKC, NFD, strip accents,
  lowercase, whitespace runs -> one space, strip; a token that is exactly one space survives);
  tokens with equal keys share an id, ids numbered in order of first appearance. A partial
  UTF-8 byte token (decodes to U+FFFD) is keyed by its raw token string.
- multipliers of a layer: `np.random.default_rng(10007 * layer_id).integers(0, B, size=N)`,
  `B = max(1, (INT64_MAX // compressed_vocab) // 2)`, then `2 * v + 1` (odd), N = max n-gram.
- context of token t: `c[t, k] = compressed[t - k]` for k < N, the pad token's compressed id
  where t - k < 0.
- rolling hash: `h_n = XOR_{k < n} c[t, k] * m[k]` (int64, wraps), for each order n = 2..N;
  column `col = (n - 2) * n_heads + head` gets row `offset[col] + h_n % prime[col]`
  (C remainder, like Triton's; h_n >= 0 for in-range ids).
"""

from __future__ import annotations

import numpy as np
import torch

from engram_ray.model.layout import MIN_NGRAM_ORDER, EngramLayout

INT64_MAX = int(np.iinfo(np.int64).max)
MULTIPLIER_SEED_STEP = 10007
# A private-use char keeps a token that is exactly " " from being stripped to "".
_SPACE_SENTINEL = "\ue000"


def _normalizer():
    from tokenizers import Regex, normalizers

    return normalizers.Sequence([
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), _SPACE_SENTINEL),
        normalizers.Strip(),
        normalizers.Replace(_SPACE_SENTINEL, " "),
    ])


def _backend(tokenizer):
    """(raw `tokenizers.Tokenizer`, vocab size incl. added tokens) of a HF or raw tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if hasattr(tokenizer, "backend_tokenizer"):
        return backend, len(tokenizer)
    return backend, backend.get_vocab_size(with_added_tokens=True)


def build_token_map(tokenizer) -> tuple[torch.Tensor, int]:
    """Compressed token map of a tokenizer (HF fast tokenizer or `tokenizers.Tokenizer`).

    Returns (`token_map` int64 `[vocab_size]`: token id -> compressed id,
    `compressed_vocab_size`). Must equal the config's `engram_compressed_vocab_size`.
    """
    backend, vocab_size = _backend(tokenizer)
    normalizer = _normalizer()
    key_to_id: dict[str, int] = {}
    token_map = [0] * vocab_size
    for token_id in range(vocab_size):
        text = backend.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = backend.id_to_token(token_id)
        else:
            key = normalizer.normalize_str(text) or text
        token_map[token_id] = key_to_id.setdefault(key, len(key_to_id))
    return torch.tensor(token_map, dtype=torch.int64), len(key_to_id)


def hash_multipliers(layout: EngramLayout, layer_idx: int) -> torch.Tensor:
    """int64 `[max_ngram_size]` odd multipliers of table `layer_idx` (seeded by its layer id)."""
    bound = max(1, (INT64_MAX // layout.compressed_vocab_size) // 2)
    generator = np.random.default_rng(MULTIPLIER_SEED_STEP * layout.layer_ids[layer_idx])
    values = generator.integers(low=0, high=bound, size=(layout.max_ngram_size,), dtype=np.int64)
    return torch.from_numpy(values * 2 + 1)


def ngram_context(compressed_ids: torch.Tensor, max_ngram_size: int,
                  pad_id: int) -> torch.Tensor:
    """One sequence's compressed ids `[num_tokens]` -> `[num_tokens, max_ngram_size]` int64,
    column k = the id k tokens back (the pad id before the sequence start)."""
    ids = compressed_ids.to(torch.int64)
    padded = torch.cat([ids.new_full((max_ngram_size - 1,), pad_id), ids])
    num_tokens = ids.shape[0]
    return torch.stack([padded[max_ngram_size - 1 - k: max_ngram_size - 1 - k + num_tokens]
                        for k in range(max_ngram_size)], dim=1)


def _check_context(context: torch.Tensor, layout: EngramLayout) -> None:
    if context.dim() != 2 or context.shape[1] != layout.max_ngram_size:
        raise ValueError(f"context is {tuple(context.shape)}; expected "
                         f"[num_tokens, {layout.max_ngram_size}] (one column per lookback)")
    if context.numel():
        low, high = int(context.min()), int(context.max())
        if low < 0 or high >= layout.compressed_vocab_size:
            raise ValueError(f"compressed ids span [{low}, {high}]; expected ids in "
                             f"[0, {layout.compressed_vocab_size}) (map token ids with "
                             "build_token_map first)")


def hash_context(context: torch.Tensor, layout: EngramLayout, layer_idx: int) -> torch.Tensor:
    """n-gram contexts `[num_tokens, max_ngram_size]` (from `ngram_context`, or gathered from a
    per-request history) -> int64 rows `[num_tokens, num_cols]` of table `layer_idx`."""
    _check_context(context, layout)
    context = context.to(torch.int64)
    device = context.device
    multipliers = hash_multipliers(layout, layer_idx).to(device)
    primes = torch.tensor(layout.primes[layer_idx], dtype=torch.int64, device=device)
    offsets = torch.tensor(layout.col_offsets[layer_idx], dtype=torch.int64, device=device)
    rolling = context[:, 0] * multipliers[0]
    per_order = []
    for order in range(MIN_NGRAM_ORDER, layout.max_ngram_size + 1):
        rolling = rolling ^ (context[:, order - 1] * multipliers[order - 1])
        per_order.append(rolling.unsqueeze(1).expand(-1, layout.n_heads))
    hashes = torch.cat(per_order, dim=1) if per_order else context[:, :0]
    return offsets + torch.fmod(hashes, primes)


def hash_ngrams(compressed_ids: torch.Tensor, layout: EngramLayout, layer_idx: int,
                pad_id: int) -> torch.Tensor:
    """One sequence's compressed ids `[num_tokens]` -> int64 rows `[num_tokens, num_cols]` of
    table `layer_idx` (column offsets included; col = (order - 2) * n_heads + head).
    `pad_id` is the compressed id of the config's `engram_pad_token_id`."""
    if compressed_ids.dim() != 1:
        raise ValueError(f"compressed_ids is {tuple(compressed_ids.shape)}; expected one "
                         "sequence [num_tokens]")
    context = ngram_context(compressed_ids, layout.max_ngram_size, pad_id)
    return hash_context(context, layout, layer_idx)
