"""Host KV cache from the host memory the peer split frees. Pure functions: no Ray, no vLLM.

With the tables split over a peer group (HBM), the host memory a CPU-offload deployment keeps
for them (`plan.make_plan(..., "host", ...)`) is free. vLLM's own CPU KV-cache offloading puts
it to use: engine argument `kv_offloading_size` (GiB per engine, "the total buffer size summed
across all TP ranks"; TP = 1 here) with `kv_offloading_backend: native` (the default), read in
vLLM 0.32/0.33 `config/cache.py` (`CacheConfig.kv_offloading_size`) and turned into an
`OffloadingConnector` with `cpu_bytes_to_use = kv_offloading_size * 2^30` by
`VllmConfig._post_init_kv_transfer_config` (`config/vllm.py`).

    cache per GPU = host freed per GPU (baseline plan - this plan) - reserve per GPU
    tokens per GPU = cache per GPU // KV bytes per token (`kv_bytes_per_token`)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engram_ray.errors import ConfigError
from engram_ray.planning.memory import GIB, MemoryPlan, gib

# Host memory per GPU left to everything else on the node when `auto` sizes the cache: the
# engine process (model loading, pinned staging buffers), Ray's object store share, the OS.
HOST_KV_RESERVE_GIB = 16.0
KV_OFFLOADING_ARG = "kv_offloading_size"  # vLLM 0.32/0.33 EngineArgs / CacheConfig field

# DeepSeek-V4.1 KV records in vLLM 0.33 (`vllm/models/deepseek_v41/attention.py`): a compressed
# KV token is one fp8_ds_mla record of 584 bytes (528 on SM100, `_use_v41_mxfp8_kv_record`);
# the larger one is used, so on GB300 the cache holds up to 584/528 = 1.11x the tokens stated.
DSV41_KV_RECORD_BYTES = 584
INDEXER_SCALE_BLOCK = 128  # fp8 indexer keys: head_dim bytes + 4 scale bytes per 128 values


@dataclass(frozen=True)
class KVTokenBytes:
    """KV-cache bytes one token takes in every layer of one engine, and how that was found."""

    num_bytes: int
    source: str


@dataclass(frozen=True)
class HostKVBudget:
    """The host KV cache of one engine (one GPU): bytes from what `plan` frees against
    `baseline`, less the reserve; tokens when the model's KV bytes per token are known."""

    freed_bytes_per_gpu: int
    reserve_bytes_per_gpu: int
    token_bytes: KVTokenBytes | None

    @property
    def cache_bytes_per_gpu(self) -> int:
        return max(0, self.freed_bytes_per_gpu - self.reserve_bytes_per_gpu)

    @property
    def tokens_per_gpu(self) -> int | None:
        if self.token_bytes is None:
            return None
        return self.cache_bytes_per_gpu // self.token_bytes.num_bytes

    def to_dict(self) -> dict:
        token = self.token_bytes
        return {"host_freed_gib_per_gpu": gib(self.freed_bytes_per_gpu),
                "reserve_gib_per_gpu": gib(self.reserve_bytes_per_gpu),
                "host_kv_cache_gib_per_gpu": gib(self.cache_bytes_per_gpu),
                "kv_bytes_per_token": token.num_bytes if token else None,
                "kv_bytes_per_token_source": token.source if token else None,
                "host_kv_cache_tokens_per_gpu": self.tokens_per_gpu}


def host_kv_budget(plan: MemoryPlan, baseline: MemoryPlan, reserve_gib: float = HOST_KV_RESERVE_GIB,
                   token_bytes: KVTokenBytes | None = None) -> HostKVBudget:
    """Host KV cache per GPU that `plan` frees against `baseline` (0 where it frees none)."""
    if isinstance(reserve_gib, bool) or not isinstance(reserve_gib, (int, float)) or \
            reserve_gib < 0:
        raise ConfigError("host_kv_reserve_gib", f"is {reserve_gib!r}", "a number of GiB >= 0")
    freed_per_gpu, _ = plan.host_freed_vs(baseline)
    return HostKVBudget(max(0, freed_per_gpu), int(reserve_gib * GIB), token_bytes)


def freed_host_kv_budget(model: str, peer_group_size: int, dp_size: int,
                         reserve_gib: float = HOST_KV_RESERVE_GIB) -> HostKVBudget:
    """`host_kv_budget` of a Serve deployment: the peer plan of `peer_group_size` against
    vLLM's CPU offload of the same gang (heads split over `dp_size`, at most the table's
    heads; one copy per engine at 1), the layout of `model` (preset or config.json)."""
    from engram_ray.model.layout import load_layout
    from engram_ray.planning.memory import make_plan

    layout = load_layout(model)
    peer = make_plan(layout, "peer", peer_group_size=peer_group_size)
    host = make_plan(layout, "host", host_mode="dp-split", dp_size=min(dp_size, layout.n_heads))
    return host_kv_budget(peer, host, reserve_gib)


def offloading_gib(requested: float | str, model: str, peer_group_size: int, dp_size: int,
                   reserve_gib: float, tables_on_host: str | None = None) -> float:
    """vLLM's `kv_offloading_size` (GiB per engine) for `serving.host_kv_cache_gib` =
    `requested` (GiB, or 'auto': all of `freed_host_kv_budget` less `reserve_gib`, rounded down
    to 0.01 GiB). Refused naming the setting when the tables stay in host memory
    (`tables_on_host` says why) or when more is asked than the split frees."""
    shown = repr(requested) if requested == "auto" else f"{requested:g}"
    if tables_on_host:
        raise ConfigError("serving.host_kv_cache_gib", f"is {shown} while {tables_on_host}: "
                          "the tables are in host memory, so the split frees none",
                          "unset, or tables in HBM (table_backend 'cuda', cpu_offload false)")
    budget = freed_host_kv_budget(model, peer_group_size, dp_size, reserve_gib)
    available = budget.cache_bytes_per_gpu / GIB
    told = (f"{budget.freed_bytes_per_gpu / GIB:.2f} GiB freed per GPU - "
            f"{reserve_gib:g} GiB host_kv_reserve_gib = {available:.2f} GiB")
    if available <= 0 or (requested != "auto" and requested > available):
        raise ConfigError("serving.host_kv_cache_gib", f"is {shown}, more than the {told}",
                          f"'auto' or at most {available:.2f} (a lower host_kv_reserve_gib "
                          "leaves more)" if available > 0 else
                          "unset: this split frees no host memory beyond the reserve")
    return math.floor(available * 100) / 100 if requested == "auto" else float(requested)


def kv_bytes_per_token(config: dict, source: str = "config") -> KVTokenBytes | None:
    """KV bytes per token of a model config.json; None where it lacks the attention fields
    (the project's presets carry only the Engram fields).

    - DeepSeek-V4.1 (`compress_ratios`, `kv_source_layer_ids`): vLLM 0.33 caches, per
      kv-source layer l below `num_hidden_layers` with compress ratio r_l > 0, one
      `DSV41_KV_RECORD_BYTES` record per r_l tokens, plus, when l is also an index source,
      indexer keys of `index_head_dim + index_head_dim / 128 * 4` bytes per r_l tokens.
      Not per token, so left out: the sliding-window cache (window tokens per request and
      layer) and the compressor state; page alignment rounds each block up a little.
    - Others: 2 (K and V) * layers * KV heads * head_dim * 2 bytes (bf16; vLLM's `auto`).
    """
    config = config.get("text_config", config) if isinstance(config, dict) else {}
    if "compress_ratios" in config and "kv_source_layer_ids" in config:
        return _deepseek_v41_token_bytes(config, source)
    layers, heads = config.get("num_hidden_layers"), config.get("num_key_value_heads")
    head_dim = config.get("head_dim")
    if head_dim is None and config.get("hidden_size") and config.get("num_attention_heads"):
        head_dim = config["hidden_size"] // config["num_attention_heads"]
    if not all(isinstance(v, int) and v > 0 for v in (layers, heads, head_dim)):
        return None
    return KVTokenBytes(2 * layers * heads * head_dim * 2,
                        f"{source}: 2 x {layers} layers x {heads} KV heads x {head_dim} x 2 "
                        "bytes (bf16 K and V)")


def _deepseek_v41_token_bytes(config: dict, source: str) -> KVTokenBytes:
    ratios, num_layers = config["compress_ratios"], config.get("num_hidden_layers", 0)
    index_sources = set(config.get("index_source_layer_ids") or ())
    index_head_dim = int(config.get("index_head_dim", 0))
    index_bytes = index_head_dim + index_head_dim // INDEXER_SCALE_BLOCK * 4
    per_token = 0.0
    for layer_id in config["kv_source_layer_ids"]:
        ratio = int(ratios[layer_id]) if layer_id < len(ratios) else 0
        if layer_id >= num_layers or ratio <= 0:
            continue
        per_token += (DSV41_KV_RECORD_BYTES + (index_bytes if layer_id in index_sources
                                               else 0)) / ratio
    return KVTokenBytes(max(1, round(per_token)),
                        f"{source}: DeepSeek-V4.1 compressed KV ({DSV41_KV_RECORD_BYTES}-byte "
                        f"records) and {index_bytes}-byte indexer keys over the kv-source "
                        "layers, vLLM 0.33 layout; sliding-window cache (per request) not "
                        "counted")
