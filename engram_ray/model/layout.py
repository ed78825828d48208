"""Engram table layout from a model's config.json: primes, rows, offsets and row format.

Per layer there are `num_orders * n_heads` hash columns, column = (order - 2) * n_heads + head.
Each column owns a prime-sized bucket range. Primes are the smallest primes above
`engram_vocab_size - 1`, drawn in the order (layer, order, head) and never reused in the model.
A row is `head_dim` FP8 e4m3 value bytes plus `head_dim // 32` ue8m0 scale bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from importlib import resources
from pathlib import Path

from engram_ray.errors import ConfigError

VALUES_PER_SCALE = 32
MIN_NGRAM_ORDER = 2

REQUIRED_FIELDS = (
    "engram_layer_ids",
    "engram_vocab_size",
    "engram_max_ngram_size",
    "engram_n_heads",
    "engram_head_dim",
    "engram_compressed_vocab_size",
    "engram_pad_token_id",
)

# Deterministic Miller-Rabin witnesses: exact for every n < 3.3e24.
_MR_WITNESSES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)


def is_prime(n: int) -> bool:
    """Deterministic primality test (Miller-Rabin with fixed witnesses), exact below 3.3e24."""
    if n < 2:
        return False
    for p in _MR_WITNESSES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in _MR_WITNESSES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def next_prime_above(n: int) -> int:
    """Smallest prime strictly greater than n."""
    candidate = n + 1
    while not is_prime(candidate):
        candidate += 1
    return candidate


@dataclass(frozen=True)
class EngramLayout:
    """Engram fields of a model config plus everything derived from them."""

    layer_ids: tuple[int, ...]
    vocab_size: int
    max_ngram_size: int
    n_heads: int
    head_dim: int
    compressed_vocab_size: int
    pad_token_id: int

    def __post_init__(self):
        if not self.layer_ids:
            raise ConfigError("engram_layer_ids", "is empty", "a non-empty list of layer indices")
        if len(set(self.layer_ids)) != len(self.layer_ids):
            raise ConfigError("engram_layer_ids", f"has duplicates: {list(self.layer_ids)}",
                              "distinct layer indices")
        for name, value, minimum in (
            ("engram_vocab_size", self.vocab_size, 2),
            ("engram_max_ngram_size", self.max_ngram_size, MIN_NGRAM_ORDER),
            ("engram_n_heads", self.n_heads, 1),
            ("engram_head_dim", self.head_dim, VALUES_PER_SCALE),
            ("engram_compressed_vocab_size", self.compressed_vocab_size, 1),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ConfigError(name, f"is {value!r}", f"an integer >= {minimum}")
        if self.head_dim % VALUES_PER_SCALE:
            raise ConfigError("engram_head_dim", f"is {self.head_dim}",
                              f"a multiple of {VALUES_PER_SCALE} (one ue8m0 scale per 32 values)")

    # --- construction -------------------------------------------------------------------

    @classmethod
    def from_config(cls, config: dict, source: str = "config") -> "EngramLayout":
        """Build from an HF-style config dict; checks `engram_num_embeddings` when present."""
        if not isinstance(config, dict):
            raise ConfigError(source, "is not a JSON object", "a model config.json object")
        config = config.get("text_config", config) if "engram_layer_ids" not in config else config
        for name in REQUIRED_FIELDS:
            if name not in config:
                raise ConfigError(f"{source}: {name}", "is missing",
                                  "the Engram fields of a DeepSeek-V4.1 config.json")
        layer_ids = config["engram_layer_ids"]
        if not isinstance(layer_ids, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layer_ids):
            raise ConfigError(f"{source}: engram_layer_ids", f"is {layer_ids!r}",
                              "a list of non-negative integers")
        pad = config["engram_pad_token_id"]
        if not isinstance(pad, int) or isinstance(pad, bool) or pad < 0:
            raise ConfigError(f"{source}: engram_pad_token_id", f"is {pad!r}",
                              "a non-negative integer")
        layout = cls(
            layer_ids=tuple(layer_ids),
            vocab_size=config["engram_vocab_size"],
            max_ngram_size=config["engram_max_ngram_size"],
            n_heads=config["engram_n_heads"],
            head_dim=config["engram_head_dim"],
            compressed_vocab_size=config["engram_compressed_vocab_size"],
            pad_token_id=pad,
        )
        layout.check_num_embeddings(config.get("engram_num_embeddings"), source)
        return layout

    def check_num_embeddings(self, num_embeddings, source: str = "config") -> None:
        """`engram_num_embeddings`, if given, must equal the computed rows of every table."""
        if num_embeddings is None:
            return
        expected = set(self.rows_per_table)
        values = num_embeddings if isinstance(num_embeddings, list) else [num_embeddings]
        if set(values) != expected and values != list(self.rows_per_table):
            raise ConfigError(f"{source}: engram_num_embeddings", f"is {num_embeddings!r}",
                              f"the computed rows per table {list(self.rows_per_table)}")

    # --- derived sizes --------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def num_orders(self) -> int:
        return self.max_ngram_size - MIN_NGRAM_ORDER + 1

    @property
    def num_cols(self) -> int:
        """Hash columns per layer: one per (order, head)."""
        return self.num_orders * self.n_heads

    @cached_property
    def primes(self) -> tuple[tuple[int, ...], ...]:
        """`primes[layer_idx][col]`, drawn in order (layer, order, head), never reused."""
        per_layer, last = [], self.vocab_size - 1
        for _ in self.layer_ids:
            cols = []
            for _ in range(self.num_cols):
                last = next_prime_above(last)
                cols.append(last)
            per_layer.append(tuple(cols))
        return tuple(per_layer)

    @cached_property
    def col_offsets(self) -> tuple[tuple[int, ...], ...]:
        """`col_offsets[layer_idx][col]`: first row of the column's bucket range in its table."""
        offsets = []
        for layer_primes in self.primes:
            starts, total = [], 0
            for prime in layer_primes:
                starts.append(total)
                total += prime
            offsets.append(tuple(starts))
        return tuple(offsets)

    @cached_property
    def rows_per_table(self) -> tuple[int, ...]:
        return tuple(sum(layer_primes) for layer_primes in self.primes)

    @property
    def num_scales(self) -> int:
        return self.head_dim // VALUES_PER_SCALE

    @property
    def row_bytes(self) -> int:
        """FP8 value bytes + ue8m0 scale bytes: 256 + 8 = 264 at head_dim 256."""
        return self.head_dim + self.num_scales

    @property
    def table_bytes(self) -> tuple[int, ...]:
        return tuple(rows * self.row_bytes for rows in self.rows_per_table)

    @property
    def total_bytes(self) -> int:
        return sum(self.table_bytes)

    def layer_idx(self, layer_id: int) -> int:
        """Index into the per-table tuples of a model layer id."""
        try:
            return self.layer_ids.index(layer_id)
        except ValueError:
            raise ConfigError("layer_id", f"{layer_id} has no Engram table",
                              f"one of {list(self.layer_ids)}") from None

    def fingerprint(self) -> str:
        """Short hash of everything peers must agree on: rows per table and row format."""
        import hashlib
        text = json.dumps([self.rows_per_table, self.head_dim, self.num_scales])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def to_dict(self) -> dict:
        return {
            "layer_ids": list(self.layer_ids),
            "num_cols": self.num_cols,
            "row_bytes": self.row_bytes,
            "tables": [
                {"layer_id": layer_id, "rows": rows, "bytes": nbytes,
                 "primes": list(primes)}
                for layer_id, rows, nbytes, primes in zip(
                    self.layer_ids, self.rows_per_table, self.table_bytes, self.primes)
            ],
            "total_bytes": self.total_bytes,
        }


PRESETS = {"deepseek-v4.1-flash": "deepseek-v4.1-flash.json"}


def load_model_config(model: str) -> tuple[dict, str]:
    """Config dict for a preset name or a path to a config.json (or a folder holding one)."""
    if model in PRESETS:
        ref = resources.files("engram_ray.cluster_configs.models") / PRESETS[model]
        return json.loads(ref.read_text()), model
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError("--model", f"{model!r} is neither a preset nor a file",
                          f"one of {sorted(PRESETS)} or a path to a config.json")
    try:
        return json.loads(path.read_text()), str(path)
    except json.JSONDecodeError as exc:
        raise ConfigError(str(path), f"is not valid JSON ({exc.msg} at line {exc.lineno})",
                          "a model config.json") from None


def load_layout(model: str) -> EngramLayout:
    config, source = load_model_config(model)
    return EngramLayout.from_config(config, source)
