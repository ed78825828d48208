"""Engram layout: primes, rows, offsets and row format from config.json."""

import json

import pytest

from engram_ray.errors import ConfigError
from engram_ray.model.layout import EngramLayout, is_prime, load_layout, next_prime_above

FLASH_FIELDS = dict(engram_layer_ids=[1, 14], engram_vocab_size=16000000,
                    engram_max_ngram_size=4, engram_n_heads=8, engram_head_dim=256,
                    engram_compressed_vocab_size=99092, engram_pad_token_id=2)


def _trial_division(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, int(n ** 0.5) + 1))


def test_is_prime_matches_trial_division():
    assert [n for n in range(3000) if is_prime(n)] == [n for n in range(3000)
                                                       if _trial_division(n)]
    assert is_prime(16000057) and not is_prime(16000057 * 16000079)
    assert is_prime(2**61 - 1) and not is_prime(3215031751)  # a strong pseudoprime to 2,3,5,7


def test_primes_are_distinct_ordered_and_next_above_vocab():
    layout = load_layout("deepseek-v4.1-flash")
    flat = [p for layer in layout.primes for p in layer]
    assert len(flat) == 2 * 24 == len(set(flat))
    assert flat == sorted(flat)
    assert flat[0] == next_prime_above(16000000 - 1)
    for prev, cur in zip(flat, flat[1:]):  # consecutive primes: nothing skipped in between
        assert not any(_trial_division(n) for n in range(prev + 1, cur))


def test_flash_sizes_match_design_figures():
    layout = load_layout("deepseek-v4.1-flash")
    assert layout.num_cols == 24 and layout.row_bytes == 264
    assert layout.rows_per_table == tuple(sum(p) for p in layout.primes)
    assert round(layout.total_bytes / 2**30, 2) == 188.83
    assert layout.col_offsets[1][0] == 0
    assert layout.col_offsets[0][5] == sum(layout.primes[0][:5])


def test_tiny_layout_offsets():
    layout = EngramLayout.from_config({**FLASH_FIELDS, "engram_vocab_size": 10,
                                       "engram_max_ngram_size": 3, "engram_n_heads": 2,
                                       "engram_head_dim": 64, "engram_layer_ids": [0, 3]})
    assert layout.primes == ((11, 13, 17, 19), (23, 29, 31, 37))
    assert layout.col_offsets == ((0, 11, 24, 41), (0, 23, 52, 83))
    assert layout.rows_per_table == (60, 120) and layout.row_bytes == 66


def test_num_embeddings_checked():
    layout = EngramLayout.from_config(FLASH_FIELDS)
    ok = {**FLASH_FIELDS, "engram_num_embeddings": list(layout.rows_per_table)}
    assert EngramLayout.from_config(ok) == layout
    with pytest.raises(ConfigError, match="engram_num_embeddings"):
        EngramLayout.from_config({**FLASH_FIELDS, "engram_num_embeddings": 12345})


@pytest.mark.parametrize("field,value,pattern", [
    ("engram_head_dim", 100, "multiple of 32"),
    ("engram_n_heads", 0, "engram_n_heads"),
    ("engram_vocab_size", -5, "engram_vocab_size"),
    ("engram_layer_ids", [], "engram_layer_ids"),
    ("engram_layer_ids", [1, 1], "duplicates"),
    ("engram_max_ngram_size", 1, "engram_max_ngram_size"),
])
def test_bad_fields_named(field, value, pattern):
    with pytest.raises(ConfigError, match=pattern):
        EngramLayout.from_config({**FLASH_FIELDS, field: value})


def test_missing_field_named():
    fields = dict(FLASH_FIELDS)
    del fields["engram_pad_token_id"]
    with pytest.raises(ConfigError, match="engram_pad_token_id: is missing"):
        EngramLayout.from_config(fields)


def test_config_path_and_bad_json(tmp_path):
    good = tmp_path / "config.json"
    good.write_text(json.dumps(FLASH_FIELDS))
    assert load_layout(str(tmp_path)) == load_layout(str(good))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_layout(str(bad))
    with pytest.raises(ConfigError, match="neither a preset nor a file"):
        load_layout("no-such-model")
