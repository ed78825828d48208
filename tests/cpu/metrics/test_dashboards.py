"""Dashboards: generated files match their code, and every panel query returns data from a real
Prometheus (127.0.0.1) scraping live engine endpoints fed by real peer tables (shm backend)."""

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from engram_ray.local.prometheus import Prometheus, scrape_config
from engram_ray.metrics.coordinator import SERIES as COORDINATOR_SERIES
from engram_ray.metrics.coordinator import CoordinatorMetrics, CoordinatorSnapshot
from engram_ray.metrics.engine import EngineIdentity, EngineMetrics
from engram_ray.metrics.exposition import MetricsServer, TargetsServer, write_file_sd
from engram_ray.model.hashing import hash_ngrams
from engram_ray.model.layout import EngramLayout
from engram_ray.tables.settings import PeerGroupSettings
from engram_ray.tables.table import open_group_tables

ROOT = Path(__file__).resolve().parents[3]
DASHBOARDS = ROOT / "dashboards"
sys.path.insert(0, str(DASHBOARDS))
import generate  # noqa: E402

TINY = EngramLayout(layer_ids=(1, 3), vocab_size=1000, max_ngram_size=3, n_heads=2,
                    head_dim=32, compressed_vocab_size=500, pad_token_id=2)
VARIABLES = {"$cluster": ".*", "$job": ".*", "$model": ".*", "$engine": ".*", "$peer_group": ".*", "$__rate_interval": "10s"}


def all_targets():
    for name, model in generate.build_dashboards().items():
        for panel in model["panels"]:
            for tgt in panel["targets"]:
                yield name, panel["title"], tgt["expr"]


def concrete(expr: str) -> str:
    for var, value in VARIABLES.items():
        expr = expr.replace(var, value)
    return expr


def test_committed_dashboards_match_the_generator():
    result = subprocess.run([sys.executable, str(DASHBOARDS / "generate.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_dashboards_are_well_formed():
    titles = {json.loads((DASHBOARDS / n).read_text())["title"]
              for n in generate.build_dashboards()}
    assert titles == {"Engram memory", "Engram step time"}
    names = {m for _, _, expr in all_targets() for m in re.findall(r"\bengram_[a-z_]+", expr)}
    defined = {m.name for m in EngineMetrics(EngineIdentity("m", "e", "g", 0)).registry.collect()}
    defined |= set(COORDINATOR_SERIES)

    def family(name):  # engram_lookup_seconds_bucket -> engram_lookup_seconds
        for suffix in ("_bucket", "_total", "_sum", "_count"):
            if name.endswith(suffix) and name[:-len(suffix)] in defined:
                return name[:-len(suffix)]
        return name

    assert {family(n) for n in names} <= defined


def test_every_panel_query_filters_on_cluster_and_job():
    for name, model in generate.build_dashboards().items():
        variables = [v["name"] for v in model["templating"]["list"]]
        assert variables[:3] == ["datasource", "cluster", "job"], name
    for name, title, expr in all_targets():
        assert 'cluster=~"$cluster"' in expr and 'job=~"$job"' in expr, (name, title, expr)
        # every selector of the query, not only the first
        selectors = re.findall(r"\{[^{}]*\}", expr.replace("{{", "").replace("}}", ""))
        assert selectors and all("$cluster" in s and "$job" in s for s in selectors), expr


def test_prometheus_config_is_valid():
    promtool = subprocess.run(["promtool", "check", "config", str(DASHBOARDS / "prometheus.yml")],
                              capture_output=True, text=True)
    assert promtool.returncode == 0, promtool.stdout + promtool.stderr


class _Engine:
    """One peer-group member with its metrics endpoint, doing real hashed lookups."""

    def __init__(self, rank: int, settings: PeerGroupSettings):
        self.metrics = EngineMetrics(EngineIdentity("tiny", f"engine-{rank}", "group-0", rank))
        # Measured at the rendezvous: table memory, then every lookup's time and rows.
        self.tables = open_group_tables(TINY, settings, metrics=self.metrics)
        # Generation index 1 ("gen-1"), as the coordinator's assignment gives it the replica.
        self.metrics.set_group(1, True, self.tables.rendezvous_seconds)
        self.metrics.set_kv_cache(capacity_bytes=1 << 30, capacity_tokens=4096, usage=0.1)
        self.server = MetricsServer([self.metrics.registry])

    def step(self, generator) -> None:
        with self.metrics.time_step():
            ids = torch.randint(0, TINY.compressed_vocab_size, (64,), generator=generator)
            for layer_idx, layer_id in enumerate(TINY.layer_ids):
                row_ids = hash_ngrams(ids, TINY, layer_idx, pad_id=TINY.pad_token_id)
                self.tables.lookup(layer_id, row_ids)

    def close(self):
        self.server.stop()
        self.tables.close()


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    store = str(tmp_path_factory.mktemp("store") / "g0")
    specs = [PeerGroupSettings(size=2, rank=r, store_dir=store, generation="gen-1",
                               timeout_s=60) for r in range(2)]
    opened, threads = {}, []
    for spec in specs:  # the rendezvous needs both members at once
        threads.append(threading.Thread(target=lambda s=spec: opened.__setitem__(
            s.rank, _Engine(s.rank, s))))
        threads[-1].start()
    for thread in threads:
        thread.join(120)
    assert sorted(opened) == [0, 1], "peer group did not form"
    yield [opened[0], opened[1]]
    for engine in opened.values():
        engine.close()


def test_the_scrape_config_keeps_the_alert_rules_wherever_it_is_written(tmp_path):
    config = scrape_config(DASHBOARDS / "prometheus.yml", str(tmp_path / "t.json"), None, "1s")
    assert config["rule_files"] and all(Path(f).is_absolute() and Path(f).exists()
                                        for f in config["rule_files"])


@pytest.fixture
def coordinator():
    """The coordinator's endpoint (its collector over a snapshot: a roll half done)."""
    snap = CoordinatorSnapshot(groups_configured=1, groups_serving=1, groups_rolling=0,
                               roll_members=2, roll_members_done=1, roll_stopped=False,
                               start_time=time.time(), restarted=False)
    server = TargetsServer(None, "127.0.0.1", 0,
                           registry=CoordinatorMetrics("tiny", "d", lambda: snap).registry)
    yield server
    server.stop()


def test_every_engram_panel_query_returns_data_from_prometheus(engines, coordinator, tmp_path):
    sd_file = tmp_path / "targets.json"
    targets = {e.metrics.identity.engine: {"target": e.server.target} for e in engines}
    targets["coordinator"] = {"target": coordinator.target(),
                              "labels": {"endpoint": "coordinator"}}
    write_file_sd(str(sd_file), targets)
    prom = Prometheus(scrape_config(DASHBOARDS / "prometheus.yml", str(sd_file), None, "1s"),
                      workdir=str(tmp_path))
    stop = threading.Event()

    def load():
        generator = torch.Generator().manual_seed(0)
        while not stop.is_set():
            for engine in engines:
                engine.step(generator)
            time.sleep(0.05)

    feeder = threading.Thread(target=load, daemon=True)
    feeder.start()
    # vLLM's series need a vLLM engine: the slow deployment test checks those panels.
    queries = [(d, t, concrete(e)) for d, t, e in all_targets() if "vllm" not in e]
    assert len(queries) >= 12
    missing, expected_up = queries, {t["target"]: "up" for t in targets.values()}
    try:
        # Until every panel has data and both engines have been scraped (a panel's query can
        # answer from one engine's series while the other's first scrape is still to come).
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(1)
            missing = [q for q in missing if not prom.query(q[2])]
            up = {t["labels"]["instance"]: t["health"] for t in prom.active_targets()}
            values = prom.query('engram_remote_row_fraction{peer_group="group-0"}')
            if not missing and up == expected_up and len(values) == 2:
                break
    finally:
        stop.set()
        feeder.join(10)
        prom.stop()
    assert not missing, f"panels without data: {missing}\n{prom.log_tail()}"
    assert up == expected_up
    # Two ranks, hashed rows spread over the table: about half the rows are remote.
    fractions = [float(v["value"][1]) for v in values]
    assert len(fractions) == 2 and all(0.2 < f < 0.8 for f in fractions)
    assert prom.proc.poll() is not None
