"""Prometheus metrics of one engram-ray engine: table memory, KV-cache headroom, lookup and step time.

Why prometheus-client and a `/metrics` endpoint per engine rather than Ray's metrics export:
histograms stay exact (Ray's export approximates histogram sums), labels stay as written, and
the endpoint also serves the process's default registry, so vLLM's own `vllm:*` metrics (its
`PrometheusStatLogger` registers there) appear beside the `engram_*` ones. Prometheus finds the
endpoints through file-based service discovery: every engine registers `host:port`, and the
deployment keeps one JSON target list current, which `dashboards/prometheus.yml` watches
(endpoint, list and the model-process hook: `engram_ray.metrics.exposition`).

Labels: `model`, `engine`, `peer_group`, `rank` on every engine series; `table` (`layer<N>`)
and `placement` (`hbm`, `host`, `peer`) on table series; `rows` (`local`, `remote`) on lookups.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from engram_ray.errors import ConfigError
from engram_ray.planning.memory import owner_of

ENGINE_LABELS = ("model", "engine", "peer_group", "rank")
TABLE_LABELS = ENGINE_LABELS + ("table", "placement")
LOOKUP_LABELS = ENGINE_LABELS + ("table", "rows")
# Lookups take microseconds (a 16-row tile) to tens of milliseconds (a long prefill on CPU).
LOOKUP_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2,
                  5e-2, 0.1, 0.25, 1.0)
# Engine steps: ~10 ms decode on GPU to seconds for a prefill on CPU.
STEP_BUCKETS = (1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass(frozen=True)
class EngineIdentity:
    """Who an engine is: the label values every `engram_*` series of it carries."""

    model: str
    engine: str
    peer_group: str
    rank: int

    def __post_init__(self):
        for name in ("model", "engine", "peer_group"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ConfigError(name, f"is {getattr(self, name)!r}", "a non-empty string")
        if not isinstance(self.rank, int) or self.rank < 0:
            raise ConfigError("rank", f"is {self.rank!r}", "an integer >= 0")

    def labels(self) -> dict[str, str]:
        return {"model": self.model, "engine": self.engine, "peer_group": self.peer_group,
                "rank": str(self.rank)}


def table_name(layer_id: int) -> str:
    """Label value of the table of Engram layer `layer_id`."""
    return f"layer{layer_id}"


def count_remote_rows(row_ids, rows_per_rank: int, rank: int) -> tuple[int, int]:
    """(local, remote) counts of valid rows (id >= 0) of `row_ids` for `rank` of a peer split.

    `row_ids`: int64 torch tensor or numpy array of any shape; row r lives on rank
    r // rows_per_rank (engram_ray.planning.memory.owner_of).
    """
    valid = row_ids[row_ids >= 0]
    owner, _ = owner_of(valid, rows_per_rank)
    num_local = int((owner == rank).sum())
    return num_local, int(valid.numel() if hasattr(valid, "numel") else valid.size) - num_local


class EngineMetrics:
    """The `engram_*` series of one engine, in its own registry (several engines may share a
    process in tests). Setters take plain numbers so any layer (actor, plugin, stat logger) can
    feed them."""

    def __init__(self, identity: EngineIdentity, registry: CollectorRegistry | None = None):
        self.identity = identity
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self._labels = identity.labels()
        self._rows_seen = {"local": 0, "remote": 0}
        self._drains: list = []
        self._member_series = False  # restarting and restarts exported (`set_group`)
        # The model process's own /metrics endpoint (exposition.start_process_metrics).
        self.server = None
        # First in the registry: a scrape publishes pending lookup samples before it reads
        # the lookup series (engram_ray.metrics.lookup_meter).
        self.registry.register(_DrainOnCollect(self._drains))
        self._define()

    def add_drain(self, drain) -> None:
        """`drain()` runs at every scrape, before the series are read (lookup samples whose
        device events completed since: engram_ray.metrics.lookup_meter.LookupMeter.drain)."""
        self._drains.append(drain)

    def _define(self) -> None:
        r, E, T, L = self.registry, ENGINE_LABELS, TABLE_LABELS, LOOKUP_LABELS
        self.table_bytes = Gauge("engram_table_bytes", "Engram table bytes held for this GPU, "
                                 "by table and placement (hbm, host, peer slice)", T, registry=r)
        self.host_bytes = Gauge("engram_host_bytes", "Host memory of this engine's Engram "
                                "tables (pinned copy, shm slice)", E, registry=r)
        self.kv_capacity_bytes = Gauge("engram_kv_cache_capacity_bytes",
                                       "KV-cache capacity of the engine", E, registry=r)
        self.kv_capacity_tokens = Gauge("engram_kv_cache_capacity_tokens",
                                        "KV-cache capacity in tokens", E, registry=r)
        self.kv_usage = Gauge("engram_kv_cache_usage_ratio", "Fraction of the KV cache in use",
                              E, registry=r)
        self.kv_headroom_bytes = Gauge("engram_kv_cache_headroom_bytes",
                                       "KV-cache bytes still free", E, registry=r)
        self.kv_headroom_tokens = Gauge("engram_kv_cache_headroom_tokens",
                                        "KV-cache tokens still free", E, registry=r)
        self.kv_gain_bytes = Gauge("engram_kv_cache_gain_bytes", "HBM per GPU freed for KV "
                                   "cache against the unsplit plan (whole tables in HBM)", E,
                                   registry=r)
        self.lookup_seconds = Histogram("engram_lookup_seconds", "Engram lookup latency, by "
                                        "table and row locality", L, buckets=LOOKUP_BUCKETS,
                                        registry=r)
        self.rows_total = Counter("engram_rows_read", "Engram rows read, by locality",
                                  E + ("rows",), registry=r)
        self.remote_fraction = Gauge("engram_remote_row_fraction", "Fraction of rows read "
                                     "from peers since start", E, registry=r)
        self.step_seconds = Histogram("engram_engine_step_seconds", "Engine step time", E,
                                      buckets=STEP_BUCKETS, registry=r)
        self.rendezvous_seconds = Gauge("engram_rendezvous_duration_seconds", "Duration of "
                                        "the last peer-group rendezvous", E, registry=r)
        self.generation = Gauge("engram_group_generation", "Peer-group generation (bumped on "
                                "every restart of the group)", E, registry=r)
        self.healthy = Gauge("engram_group_healthy", "1 while the engine's peer group "
                             "serves (its members complete; one restarting its engine in "
                             "place leaves it serving), else 0", E, registry=r)
        self.restarting = Gauge("engram_engine_restarting", "1 while this member's engine "
                                "restarts in place (engine death, its DP gang's, or a "
                                "settings roll): its group serves on the other members", E,
                                registry=r)
        self.reattached = Gauge("engram_slices_reattached", "1 when this engine mapped its "
                                "table slices from their holders after an engine restart (no "
                                "checkpoint read, no rendezvous), 0 when it filled them", E,
                                registry=r)
        self.reattach_seconds = Gauge("engram_slices_reattach_duration_seconds", "Time this "
                                      "engine took to map and check every slice from their "
                                      "holders", E, registry=r)
        self.engine_restarts = Counter("engram_engine_restarts", "Restarts of this member's "
                                       "engine inside its replica (same generation, rank and "
                                       "slice)", E, registry=r)

    # --- memory -------------------------------------------------------------------------
    def set_table_plan(self, plan, baseline, layer_ids, host_bytes: int | None = None) -> None:
        """Table bytes per GPU from `plan` (engram_ray.planning.memory.MemoryPlan), the KV-cache gain
        against `baseline` (the unsplit plan), host bytes (default: the plan's)."""
        for layer_id, nbytes in zip(layer_ids, plan.hbm_bytes_per_gpu_by_table):
            self.table_bytes.labels(**self._labels, table=table_name(layer_id),
                                    placement=plan.placement).set(nbytes)
        if plan.placement == "host":
            for layer_id, nbytes in zip(layer_ids, plan.table_bytes):
                share = plan.host_bytes_per_gpu * nbytes // max(1, sum(plan.table_bytes))
                self.table_bytes.labels(**self._labels, table=table_name(layer_id),
                                        placement="host").set(share)
        host = plan.host_bytes_per_gpu if host_bytes is None else host_bytes
        self.host_bytes.labels(**self._labels).set(host)
        self.kv_gain_bytes.labels(**self._labels).set(plan.kv_gain_vs(baseline))

    def set_table_memory(self, tables, baseline=None) -> None:
        """Table bytes and host bytes this engine really allocated (`tables.stats()` of
        `engram_ray.tables.table.EngramTables`), and the KV-cache gain against `baseline` (the
        unsplit plan). The `shm` backend keeps slices in host memory, so its bytes also count
        as host bytes."""
        stats = tables.stats()
        placement = "peer" if stats["size"] > 1 else "hbm"
        total = 0
        for table in stats["tables"]:
            self.table_bytes.labels(**self._labels, table=table_name(table["layer_id"]),
                                    placement=placement).set(table["local_bytes"])
            total += table["local_bytes"]
        self.host_bytes.labels(**self._labels).set(total if stats["backend"] == "shm" else 0)
        if baseline is not None:
            self.kv_gain_bytes.labels(**self._labels).set(baseline.hbm_bytes_per_gpu - total)

    def set_kv_cache(self, capacity_bytes: int, capacity_tokens: int, usage: float) -> None:
        """Capacity and use of the KV cache; headroom = capacity * (1 - usage)."""
        usage = min(1.0, max(0.0, float(usage)))
        labels = self._labels
        self.kv_capacity_bytes.labels(**labels).set(capacity_bytes)
        self.kv_capacity_tokens.labels(**labels).set(capacity_tokens)
        self.kv_usage.labels(**labels).set(usage)
        self.kv_headroom_bytes.labels(**labels).set(int(capacity_bytes * (1.0 - usage)))
        self.kv_headroom_tokens.labels(**labels).set(int(capacity_tokens * (1.0 - usage)))

    # --- time ---------------------------------------------------------------------------
    def observe_lookup(self, table: str, seconds: float, num_local: int, num_remote: int) -> None:
        """One lookup: its latency goes to the `local` or `remote` series (remote if it read
        any peer row); row counts feed the remote fraction."""
        rows = "remote" if num_remote else "local"
        self.lookup_seconds.labels(**self._labels, table=table, rows=rows).observe(seconds)
        for kind, count in (("local", num_local), ("remote", num_remote)):
            self.rows_total.labels(**self._labels, rows=kind).inc(count)
            self._rows_seen[kind] += count
        total = self._rows_seen["local"] + self._rows_seen["remote"]
        if total:
            self.remote_fraction.labels(**self._labels).set(self._rows_seen["remote"] / total)

    def observe_step(self, seconds: float) -> None:
        self.step_seconds.labels(**self._labels).observe(seconds)

    @contextmanager
    def time_step(self):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.observe_step(time.perf_counter() - start)

    # --- group --------------------------------------------------------------------------
    def set_reattached(self, seconds: float) -> None:
        self.reattached.labels(**self._labels).set(1)
        self.reattach_seconds.labels(**self._labels).set(seconds)

    def count_engine_restart(self) -> None:
        self.engine_restarts.labels(**self._labels).inc()

    def set_restarting(self, is_restarting: bool) -> None:
        self.restarting.labels(**self._labels).set(1 if is_restarting else 0)

    def set_group(self, generation: int, is_healthy: bool,
                  rendezvous_seconds: float | None = None) -> None:
        if not self._member_series:  # a member's restart series from its first report on
            self._member_series = True
            self.set_restarting(False)
            self.engine_restarts.labels(**self._labels)
        self.generation.labels(**self._labels).set(generation)
        self.healthy.labels(**self._labels).set(1 if is_healthy else 0)
        if rendezvous_seconds is not None:
            self.rendezvous_seconds.labels(**self._labels).set(rendezvous_seconds)


def time_on_host(metrics: EngineMetrics, layer_id: int, rows_per_rank: int, rank: int,
                 lookup, row_ids):
    """`lookup()` of `row_ids` timed on the host clock, local/remote rows counted: right for
    CPU lookups only (CUDA launches return before the work is done: engram_ray.metrics.lookup_meter
    times those with events)."""
    start = time.perf_counter()
    result = lookup()
    seconds = time.perf_counter() - start
    metrics.observe_lookup(table_name(layer_id), seconds,
                           *count_remote_rows(row_ids, rows_per_rank, rank))
    return result


class _DrainOnCollect:
    """A collector with no series of its own: runs the drains when the registry is read."""

    def __init__(self, drains: list):
        self._drains = drains

    def collect(self):
        for drain in list(self._drains):
            drain()
        return []
