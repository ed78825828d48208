"""The local deployment end to end (slow): `engram-ray local` as a user runs it, then the OpenAI
API, malformed requests, requests generated from the API's schema (hypothesis), every dashboard
panel through a real Prometheus, 100 concurrent streams, an engine killed under load, an engine
core killed just before a status line, Ctrl-C followed by a clean second run, SIGTERM stopping a
third as cleanly, and a fourth whose worker dies before the deployment is ready (reported in
one line).

One deployment for the whole module (two vLLM engines on CPU take a minute or more to start);
the SIGTERM test starts its own.
"""

import glob
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from hypothesis import HealthCheck, given, settings

from engram_ray.local.loadgen import run_load
from engram_ray.local.prometheus import Prometheus, free_port, scrape_config
from engram_ray.local.summary import engine_row, merge_by_engine
from engram_ray.serve.member import engine_shm
from engram_ray.serve.edge.api_errors import leaks

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "dashboards"))
sys.path.insert(0, str(ROOT / "tests"))
import generate  # noqa: E402
from support.openai_requests import openai_requests  # noqa: E402

MODEL = "engram-tiny"
STARTUP_S = 900
SUMMARY_EVERY_S = 5
GENERATED_REQUESTS = 60  # property-based requests (valid and broken), a minute or two on CPU


def _parent(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])  # the field after "(comm) state"


def _descends_from(pid: int, ancestor: int) -> bool:
    try:
        while pid > 1:
            pid = _parent(pid)
            if pid == ancestor:
                return True
    except (OSError, ValueError, IndexError):
        pass
    return False


def vllm_processes(title: str, under: int) -> list[int]:
    """PIDs of vLLM's processes by title ("VLLM::EngineCore", "VLLM::Worker") below process
    `under` (a deployment's `engram-ray local`, which starts Ray, whose workers start vLLM):
    other deployments' engines (the module's shared one, other test runs) are not this test's."""
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if (proc / "cmdline").read_bytes().startswith(title.encode()):
                pids.append(int(proc.name))
        except OSError:
            continue
    return [pid for pid in pids if _descends_from(pid, under)]


def engine_segments() -> set[str]:
    """vLLM's shared-memory ring buffers (engram_ray.serve.member.engine_shm)."""
    return {path for path in glob.glob("/dev/shm/psm_*")
            if engine_shm.SEGMENT_NAME.fullmatch(path)}


class Local:
    def __init__(self, workdir: Path, *options: str, port: int | None = None):
        self.workdir, self.port = workdir, port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.out, self.err = workdir / "out.txt", workdir / "err.txt"
        self.segments_before = engine_segments()
        self.proc = subprocess.Popen(
            ["engram-ray", "local", "--workdir", str(workdir), "--port", str(self.port),
             "--summary-every", str(SUMMARY_EVERY_S), *options],
            stdout=open(self.out, "w"), stderr=open(self.err, "w"), start_new_session=True)

    def wait_for(self, text: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            out = self.out.read_text()
            if text in out:
                return out
            if self.proc.poll() is not None:
                break
            time.sleep(2)
        raise AssertionError(f"no {text!r} (rc {self.proc.poll()}):\n{self.out.read_text()}\n"
                             f"{self.err.read_text()[-4000:]}")

    def wait_for_count(self, text: str, count: int, timeout_s: float) -> str:
        """stdout once `text` occurs `count` times in it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            out = self.out.read_text()
            if out.count(text) >= count:
                return out
            time.sleep(0.5)
        raise AssertionError(f"{text!r} not {count} times (rc {self.proc.poll()}):\n"
                             f"{self.out.read_text()[-4000:]}\n{self.err.read_text()[-4000:]}")

    @property
    def ray_address(self) -> str:
        return re.search(r"^ray:\s+(\S+)", self.out.read_text(), re.M).group(1)

    @property
    def targets_file(self) -> Path:
        return self.workdir / "prom_targets.json"

    def engine_rows(self) -> list[dict]:
        """One row per engine, its replica's and its model process's endpoints merged."""
        texts = {}
        for group in json.loads(self.targets_file.read_text()):
            if group["labels"].get("endpoint") == "coordinator":
                continue
            url = f"http://{group['targets'][0]}/metrics"
            with urllib.request.urlopen(url, timeout=5) as resp:
                texts[url] = resp.read().decode()
        return [engine_row(samples) for samples in merge_by_engine(texts).values()]

    def post(self, path: str, body: bytes | dict) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    deployment = Local(tmp_path_factory.mktemp("local"))
    try:
        deployment.wait_for("live metrics:", STARTUP_S)
        yield deployment
    finally:
        if deployment.proc.poll() is None:
            deployment.proc.send_signal(signal.SIGINT)
            try:
                deployment.proc.wait(120)
            except subprocess.TimeoutExpired:
                deployment.proc.kill()


def test_check_prints_completion_plan_endpoint_and_metrics(local):
    out = local.out.read_text()
    assert "completion of 'The river':" in out
    assert "deepseek-v4.1-flash" in out and "23.60" in out  # the plan, per GPU in a group of 8
    assert f"endpoint: {local.url}/v1" in out
    rows = local.engine_rows()
    assert sorted(r["engine"] for r in rows) == ["group-0-r0", "group-0-r1"]
    assert all(r["healthy"] and r["generation"] == 1 and r["kv_tokens"] > 0 for r in rows)
    # The engines really split the tables: the one that answered read rows from its peer.
    assert max(r["lookups"] for r in rows) > 0
    assert 0.2 < max(r["remote_fraction"] for r in rows) < 0.8


def test_openai_completions_chat_and_streaming(local):
    from openai import OpenAI

    client = OpenAI(base_url=f"{local.url}/v1", api_key="x")
    assert [m.id for m in client.models.list().data] == [MODEL]
    done = client.completions.create(model=MODEL, prompt="The river", max_tokens=8,
                                     temperature=0.0)
    assert done.usage.completion_tokens >= 1
    chat = client.chat.completions.create(model=MODEL, max_tokens=8,
                                          messages=[{"role": "user", "content": "hello"}])
    assert chat.choices[0].message.role == "assistant"
    chunks = list(client.completions.create(model=MODEL, prompt="The river", max_tokens=8,
                                            stream=True))
    assert len(chunks) >= 2


def test_each_ingress_replica_runs_the_ingress_on_its_own_event_loop(local):
    """Both ingress replicas of the default settings carry Serve's settings that run the
    ingress and its router on the replica's event loop (`app.INGRESS_ENV_VARS`); the engines
    do not (their replica's loop is blocked while vLLM starts)."""
    import psutil

    from engram_ray.serve.app import INGRESS_ENV_VARS

    titles = {p: " ".join(p.info["cmdline"] or [""]).split(" ")[0]
              for p in psutil.process_iter(["cmdline"])}
    ingress = [p for p, title in titles.items() if "PeerGroupIngress" in title]
    engines = [p for p, title in titles.items() if "EngramLLMServer" in title]
    assert len(ingress) == 2 and len(engines) == 2, titles
    for process in ingress:
        assert {k: process.environ().get(k) for k in INGRESS_ENV_VARS} == INGRESS_ENV_VARS
    for process in engines:
        assert not set(INGRESS_ENV_VARS) & set(process.environ())


MALFORMED = [
    ("bad JSON", b'{"model": "engram-tiny", "prompt": '),
    ("unknown model", {"model": "no-such-model", "prompt": "hi", "max_tokens": 4}),
    ("negative max_tokens", {"model": MODEL, "prompt": "hi", "max_tokens": -5}),
    ("prompt over the context length", {"model": MODEL, "prompt": "river " * 3000,
                                        "max_tokens": 4}),
]


@pytest.mark.parametrize("what,body", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_request_gets_openai_4xx_and_engines_stay_up(local, what, body):
    status, error = local.post("/v1/completions", body)
    assert 400 <= status < 500, (what, status, error)
    assert "error" in error or "detail" in error, error
    status, ok = local.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4})
    assert status == 200, ok
    assert all(r["healthy"] and r["generation"] == 1 for r in local.engine_rows())


@settings(max_examples=GENERATED_REQUESTS, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(generated=openai_requests(MODEL))
def test_generated_requests_get_200_or_a_clean_4xx(local, generated):
    """Completion and chat requests generated from their schema, valid and broken
    (tests/support/openai_requests.py): each gets a complete 200 or a 4xx in OpenAI's error
    shape whose body leaks nothing (no traceback, path or internal name)."""
    import httpx

    path, body = generated
    with httpx.Client(timeout=120) as http:
        resp = http.post(local.url + path, content=body,
                         headers={"Content-Type": "application/json"})
    text = resp.text
    assert resp.status_code == 200 or 400 <= resp.status_code < 500, (body, resp.status_code,
                                                                       text[:500])
    if resp.status_code == 200:
        assert "data: [DONE]" in text if text.startswith("data:") else json.loads(text)["choices"]
    else:
        assert json.loads(text)["error"]["message"] and not leaks(text), (body, text[:500])


def test_a_plain_request_succeeds_after_the_generated_ones(local):
    assert _greedy(local, "hello")
    assert all(r["healthy"] and r["generation"] == 1 for r in local.engine_rows())


def test_every_dashboard_panel_returns_data_from_prometheus(local, tmp_path):
    prom = Prometheus(scrape_config(ROOT / "dashboards" / "prometheus.yml",
                                    str(local.targets_file), None, "1s"), workdir=str(tmp_path))
    stop = threading.Event()

    def traffic():
        while not stop.is_set():
            run_load(f"{local.url}/v1", MODEL, num_streams=8, max_tokens=8, timeout_s=60)

    feeder = threading.Thread(target=traffic, daemon=True)
    feeder.start()
    queries = [(panel["title"], re.sub(r'=~"\$\w+"', '=~".*"',  # every variable: all values
                                       tgt["expr"].replace("$__rate_interval", "15s")))
               for model in generate.build_dashboards().values()
               for panel in model["panels"] for tgt in panel["targets"]]
    missing = queries
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and missing:
            time.sleep(2)
            missing = [(t, q) for t, q in missing if not prom.query(q)]
    finally:
        stop.set()
        feeder.join(90)
        prom.stop()
    assert missing == [], missing


def test_100_concurrent_streams_without_failure(local):
    report = run_load(f"{local.url}/v1", MODEL, num_streams=100, max_tokens=16, timeout_s=120)
    summary = report.summary()
    print(json.dumps(summary, indent=1))
    assert summary["num_failed"] == 0, summary["errors"]
    assert report.wall_s < 120


def test_tiny_vllm_bench_serve_on_both_endpoints(local, tmp_path):
    """`vllm bench serve` (engram_ray.local.vllm_bench, as benchmarks/bench_serving.py runs
    it) against the local deployment: every request of each endpoint completes."""
    from engram_ray.local import vllm_bench

    for endpoint in ("completions", "chat"):
        result = vllm_bench.bench_serve(local.url, MODEL, str(local.workdir / "tiny-model"),
                                        endpoint, result_dir=str(tmp_path / "bench"),
                                        label=endpoint, num_prompts=4, input_len=16,
                                        output_len=4, max_concurrency=2, timeout_s=600)
        assert result["completed"] == 4 and result["failed"] == 0, result.get("errors")
        assert result["total_output_tokens"] == 4 * 4  # the random dataset ignores EOS
        assert result["request_throughput"] > 0 and result["p99_ttft_ms"] > 0
        assert result["backend"] == vllm_bench.ENDPOINTS[endpoint][0]


def _greedy(local, prompt: str = "The river") -> str:
    status, body = local.post("/v1/completions", {"model": MODEL, "prompt": prompt,
                                                  "max_tokens": 16, "temperature": 0.0})
    assert status == 200, body
    return body["choices"][0]["text"]


def test_engine_core_killed_under_load_restarts_alone_while_its_peer_serves(local):
    """kill -9 of one member's EngineCore under load (one group of two): its peer answers every
    request sent after the kill, the member restarts its engine in the same generation with
    its slices re-attached from its replica's holder (not reloaded), nothing of the dead
    engine is left (processes, ring buffers), and greedy answers stay token-identical before,
    during and after."""
    from engram_ray.local.loadgen import LOST, Traffic

    reference = _greedy(local)
    before = {r["engine"]: r for r in local.engine_rows()}
    generation = {r["generation"] for r in before.values()}
    cores = vllm_processes("VLLM::EngineCore", local.proc.pid)
    workers = vllm_processes("VLLM::Worker", local.proc.pid)
    assert len(cores) == len(workers) == 2
    victims = [cores[0], *(w for w in workers if _descends_from(w, cores[0]))]
    assert len(victims) == 2
    traffic = Traffic(f"{local.url}/v1", MODEL, concurrency=6, max_tokens=32).start()
    try:
        time.sleep(3.0)
        killed_at = time.monotonic()
        os.kill(cores[0], signal.SIGKILL)
        time.sleep(2.0)
        during = [_greedy(local) for _ in range(3)]  # the peer alone serves these
        back_s = None
        while back_s is None and time.monotonic() - killed_at < 240:
            time.sleep(1.0)
            try:
                rows = {r["engine"]: r for r in local.engine_rows()}
            except (OSError, ValueError):
                continue
            if len(rows) == 2 and any(r["restarts"] == 1 and r["healthy"]
                                      for r in rows.values()):
                back_s = time.monotonic() - killed_at
        time.sleep(3.0)
        results = traffic.stop()
    finally:
        traffic.stop()
    failures = [r for r in results if not r.ok]
    print(f"member back after {back_s} s; {len(results)} requests, {len(failures)} failed: "
          f"{sorted({f.error[:80] for f in failures})[:5]}")
    assert back_s is not None, local.out.read_text()[-3000:]
    assert not [r for r in results if r.outcome == LOST]
    # Only requests running on the dead engine fail, visibly; every later one is answered.
    assert len(failures) <= 6 and all(f.error for f in failures), failures[:3]
    assert all(r.ok for r in results if r.started_at > killed_at + 1.0), failures[:3]
    assert sum(r.ok and r.started_at > killed_at + 1.0 for r in results) > 10
    rows = {r["engine"]: r for r in local.engine_rows()}
    (restarted,) = [e for e, r in rows.items() if r["restarts"] == 1]
    assert rows[restarted]["reattached"] and {r["generation"] for r in rows.values()} == generation
    assert rows[restarted]["table_mib"] == before[restarted]["table_mib"]
    assert during == [reference] * 3 and _greedy(local) == reference
    # The dead engine's processes are gone and its ring buffers released; slices are unlinked.
    assert not [pid for pid in victims if Path(f"/proc/{pid}").exists()]
    assert len(vllm_processes("VLLM::EngineCore", local.proc.pid)) == 2
    assert len(vllm_processes("VLLM::Worker", local.proc.pid)) == 2
    unused = engine_segments() - local.segments_before
    assert not unused - set(engine_shm._users(sorted(unused))), "segments of the dead engine"
    assert not list(Path("/dev/shm").glob("engram-ray-local-*"))


def test_killed_engine_restarts_its_group_and_serving_resumes(local):
    """One engine killed under load: Serve stops its whole group (the survivor too) and starts
    a new gang; answers, each tagged with the generation that produced it, never come from
    the old generation once the new one has answered. With the only group down, no request is
    lost silently and new ones fail fast: 503 with Retry-After, until the group serves again."""
    import ray

    from engram_ray.local.loadgen import LOST, Traffic, check_generation_order, probe_generations

    if ray.is_initialized():  # a driver left by an earlier module would refuse a second init
        ray.shutdown()
    ray.init(address=local.ray_address, log_to_driver=False)
    stop, answers = threading.Event(), []
    prober = threading.Thread(target=probe_generations, args=(f"{local.url}/v1", MODEL, stop),
                              kwargs={"answers": answers})
    try:
        replicas = [a for a in ray.util.list_named_actors(all_namespaces=True)
                    if "EngramLLMServer" in a["name"]]
        assert len(replicas) == 2, replicas
        victim = ray.get_actor(replicas[0]["name"], namespace=replicas[0]["namespace"])
        traffic = Traffic(f"{local.url}/v1", MODEL, concurrency=8, max_tokens=64).start()
        prober.start()
        deadline = time.monotonic() + 120  # the first generation answers before the kill
        while not any(generation for _, generation in answers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert any(generation for _, generation in answers), answers[-3:]
        time.sleep(1.0)
        killed_at = time.monotonic()
        ray.kill(victim, no_restart=True)
        recovered_s = _wait_until_serving_generation(local, 2, timeout_s=600) - killed_at
        time.sleep(2)  # a few answers from the new generation
        results = traffic.stop()
        now = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
               if "EngramLLMServer" in a["name"]}
    finally:
        stop.set()
        prober.join(120)
        ray.shutdown()
    failures = [r for r in results if not r.ok]
    print(f"recovered after {recovered_s:.0f} s; {len(results)} requests, {len(failures)} "
          f"failed: {sorted({f.error[:80] for f in failures})[:5]}")
    assert not [r for r in results if r.outcome == LOST]
    assert all(f.error for f in failures)  # a failure says what happened
    late = [r for r in failures if r.started_at > killed_at + 2.0]
    assert late and all(r.status == 503 and r.retry_after for r in late), late[:3]
    assert max(r.total_s for r in late) < 5.0  # refused at once, not held
    (order,) = check_generation_order(answers).values()
    assert len(order) == 2 and order[1].split(".")[1] == "2", order
    assert len(now) == 2 and now.isdisjoint(a["name"] for a in replicas)  # survivor replaced too


def test_engine_core_killed_just_before_a_status_line_keeps_the_deployment(local):
    """kill -9 of an EngineCore ~1.5 s before a status line: its metrics endpoint is still
    listed then; the status line shows the engine as not answering (or its recorded death),
    the deployment keeps running, and serves both engines again once the member restarted."""
    generation = max(r["generation"] for r in local.engine_rows())
    blocks = local.out.read_text().count("live metrics:")
    local.wait_for_count("live metrics:", blocks + 1, timeout_s=60)
    time.sleep(SUMMARY_EVERY_S - 1.5)
    [victim, *_] = vllm_processes("VLLM::EngineCore", local.proc.pid)
    os.kill(victim, signal.SIGKILL)
    out = local.wait_for_count("live metrics:", blocks + 3, timeout_s=60)
    after = out.split("live metrics:")[blocks + 2:]
    assert any("not answering" in b or "died while serving" in b for b in after), after
    _wait_until_serving_generation(local, generation, timeout_s=600)  # restarted in place
    assert local.proc.poll() is None
    count = local.out.read_text().count("live metrics:")
    last = local.wait_for_count("live metrics:", count + 1, timeout_s=60).split(
        "live metrics:")[-1]
    assert "group-0-r0" in last and "group-0-r1" in last and "not answering" not in last, last
    assert "Traceback" not in local.out.read_text() + local.err.read_text()


def _wait_until_serving_generation(local, generation: int, timeout_s: float) -> float:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(3)
        try:
            rows = local.engine_rows()
            status, _ = local.post("/v1/completions", {"model": MODEL, "prompt": "hi",
                                                       "max_tokens": 4})
        except (OSError, ValueError):
            continue
        if status == 200 and len(rows) == 2 and all(
                r["healthy"] and r["generation"] >= generation for r in rows):
            return time.monotonic()
    raise AssertionError(f"not serving generation {generation} after {timeout_s} s")


def test_ctrl_c_stops_cleanly_and_a_second_run_starts_clean_and_stops_on_sigterm(local):
    """Ctrl-C stops Serve and Ray and removes everything; a second run in the same workdir on
    the same port serves again, and `kill` (SIGTERM: systemd, docker stop) stops it alike."""
    local.proc.send_signal(signal.SIGINT)
    assert local.proc.wait(120) == 130
    assert "stopping: Serve, Ray" in local.err.read_text()
    assert not list(Path("/dev/shm").glob("engram-ray-local-*"))
    # vLLM's ring buffers of every engine, the one killed above included (engram_ray.serve.
    # engine_shm); and the record of each replica's segments
    assert not engine_segments() - local.segments_before
    assert not list(engine_shm.RECORDS.glob("*.json"))
    assert not (local.workdir / "store" / "local").exists()
    assert not local.targets_file.exists()
    # Model processes hand their metrics address over in a file each replica removes once read.
    handoff = Path(tempfile.gettempdir(), "engram-ray", "model-targets")
    assert handoff.is_dir() and not list(handoff.glob("*.json"))
    host, port = local.ray_address.rsplit(":", 1)
    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=2).close()
    again = Local(local.workdir, port=local.port)
    try:
        out = again.wait_for("live metrics:", STARTUP_S)
        again.proc.send_signal(signal.SIGTERM)
        assert again.proc.wait(120) == 130
    finally:
        if again.proc.poll() is None:
            again.proc.kill()
    assert "completion of 'The river':" in out
    assert "stopping: Serve, Ray" in again.err.read_text()
    assert not list(Path("/dev/shm").glob("engram-ray-local-*"))
    assert not (again.workdir / "store" / "local").exists()
    assert not engine_segments() - again.segments_before


def test_worker_dying_before_ready_is_reported_in_one_line(tmp_path):
    """A vLLM worker killed by SIGILL while its engine starts (what an AMX CPU did to workers
    that had not requested the tile state): one line with the engine and its cause, exit code
    2, no traceback, everything stopped and removed (the ring buffers the engine made before
    it died included: the replica records them while the engine starts)."""
    from engram_ray.serve.member.engine_shm import processes_using

    segments_before = set(Path("/dev/shm").glob("psm_*"))
    run = Local(tmp_path, "--once")
    try:
        deadline = time.monotonic() + STARTUP_S
        while not vllm_processes("VLLM::Worker", run.proc.pid) and time.monotonic() < deadline:
            assert run.proc.poll() is None, run.err.read_text()[-4000:]
            time.sleep(0.2)
        os.kill(vllm_processes("VLLM::Worker", run.proc.pid)[0], signal.SIGILL)
        assert run.proc.wait(300) == 2
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
    err, out = run.err.read_text(), run.out.read_text()
    last = err.strip().splitlines()[-1]
    assert re.fullmatch(r"engram-ray local: error: engine group-0-r[01] died while starting: "
                        r"worker exited with SIGILL \(illegal instruction\)[^;]*; see /\S+",
                        last), err[-4000:]
    assert Path(last.rsplit("see ", 1)[1]).is_file()  # the replica's log
    assert "Traceback" not in err + out
    assert "stopping: Serve, Ray" in err
    assert not list(Path("/dev/shm").glob("engram-ray-local-*"))
    assert not (run.workdir / "store" / "local").exists()
    left = [str(p) for p in set(Path("/dev/shm").glob("psm_*")) - segments_before]
    assert not [p for p in left if not processes_using([p])], left
