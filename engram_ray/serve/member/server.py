"""Serve replicas that are engram-ray engines: Ray Serve LLM's `LLMServer` (or `DPServer` for
data-parallel gangs) plus a place in a peer group, the group's table settings for vLLM, and
metrics.

One peer group = one Serve gang (`engram_ray.serve.app`, `actors/placement.py`): the replica's rank
and the group's size come from `serve.get_replica_context().gang_context`, its generation and
store folder from the coordinator (`actors/coordinator.py`), which opens a new generation for
every new gang id. Start of a replica (`start`, before vLLM starts):
  join the coordinator ─► `additional_config["engram_peer_group"]` (the vLLM plugin opens this
  rank's slice and meets the group in the FileStore rendezvous while the engine loads)
  ─► `/metrics` endpoint registered as a Prometheus target ─► vLLM engine (Ray Serve LLM)
  ─► KV-cache capacity and a stat logger feeding KV usage and step time.
Failure: a member whose engine dies (EngineCore or a worker) restarts that engine in place, in
its generation, re-attaching its slices from the slice holder this replica runs, with the
other members of its data-parallel gang if it has one (`restart`);
the group's other members (other DP gangs) serve throughout and the
ingress sends the member nothing until it is back. A member lost otherwise (its replica, GPU or
node, a restart that failed, health checks failed as many times in a row as make Serve restart
it; one failure that passes next time is not a loss) makes Serve stop every member of its gang
and start a new gang (RESTART_GANG), so no engine serves next to peers of another generation.
The replica tells the coordinator within a fraction of a second (`engine.MemberEngine`), and the
coordinator pings every member's actor; the ingress routes by what the coordinator says
(`engram_ray.serve.edge.ingress`). Answers carry the generation id that produced them
(`system_fingerprint`).
"""

# Over 300 lines: Serve's hooks of one member over Ray Serve LLM's two server classes (its start
# with join, holder and metrics endpoints; health check; requests; stop). Each hands its work
# to one of the member's parts (`engram_ray.serve.member`).

from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
import time

from ray.serve._private.constants import REPLICA_HEALTH_CHECK_UNHEALTHY_THRESHOLD
from ray.serve.llm.deployment import DPServer, LLMServer  # Ray 2.60's public names

from engram_ray.errors import EngramRayError
from engram_ray.metrics.engine import EngineIdentity, EngineMetrics
from engram_ray.metrics.exposition import (PROCESS_METRICS_KEY, MetricsServer, metrics_port,
                                           port_name)
from engram_ray.planning.assignment import deaths_dir
from engram_ray.serve.member.engine import MemberEngine
from engram_ray.serve.member.engine_death import EngineDiedError, EngineWatch
from engram_ray.serve.member.engine_shm import recording_segments, release_leftovers
from engram_ray.serve.member.kv_cache import engine_capacity
from engram_ray.serve.member.link import CoordinatorLink, current_rollout
from engram_ray.serve.member.processes import end_engine, own_actor
from engram_ray.serve.member.requests import MemberRequests
from engram_ray.serve.member.restart import InPlaceRestart
from engram_ray.serve.member.roll import SettingsRoll
from engram_ray.serve.member.stat_logger import EngramStatLogger
from engram_ray.tables.settings import PeerGroupSettings

APP_CONFIG_KEY = "engram_app"
GROUP_KEY = "engram_group"  # {"group_id", "domain_id"} of the group deployment
# Failed health checks in a row after which Serve restarts a replica (and so its gang).
FAILED_CHECKS_TO_RESTART = REPLICA_HEALTH_CHECK_UNHEALTHY_THRESHOLD
LEAVE_TIMEOUT_S = 5.0  # how long a stopping or failed replica waits to tell the coordinator
logger = logging.getLogger("ray.serve")


def peer_group_settings(assignment: dict, dp_rank: int = 0,
                        holders: bool = False) -> PeerGroupSettings:
    """This replica's `engram_ray.tables.settings.PeerGroupSettings` from its coordinator
    assignment: `rank` is the member of DP rank 0 of its data-parallel gang (the plugin adds
    the DP rank); a handle type only when the deployment requests one; `holders` when the
    replica holds its engine's slices (`engram_ray.tables.slice_holder`)."""
    keys = ("size", "store_dir", "generation", "timeout_s", "backend", "handle_type")
    return PeerGroupSettings(rank=assignment["member_rank"] - dp_rank, holders=holders,
                             holder_token=assignment.get("holder_token"),
                             **{key: assignment[key] for key in keys})


class EngramServerMixin:
    """Everything engram-ray adds to a Ray Serve LLM server class (see module docstring):
    Serve's hooks (start, health check, requests, stop), each handed to the member's parts."""

    _failed_checks = 0  # health checks failed in a row while the engine lives
    _reported_broken = False

    def _make_parts(self) -> None:
        self._requests, self._member_engine = MemberRequests(), MemberEngine(self)
        self._link, self._restarts = CoordinatorLink(self), InPlaceRestart(self)
        self._roll = SettingsRoll(self)

    async def start(self):
        from engram_ray.actors.coordinator_lookup import find_coordinator
        from engram_ray.serve.settings.config import ServeAppConfig
        from engram_ray.serve.settings.engine_args import engine_kwargs

        self._make_parts()
        raw = self._llm_config.experimental_configs[APP_CONFIG_KEY]
        self._app = ServeAppConfig.from_dict(raw, "replica")
        build_kwargs = engine_kwargs(self._app)  # what the build set; the rest is the class's
        self._member_engine.own_kwargs = {k: v for k, v in self._llm_config.engine_kwargs.items()
                                          if k not in build_kwargs}
        self._coordinator = find_coordinator(self._app.deployment.name)
        self._replica_id, gang, labels = self._replica()
        self._replica_labels = labels
        joined_at = time.perf_counter()
        group_id = self._llm_config.experimental_configs[GROUP_KEY]["group_id"]
        self._assignment = a = await self._coordinator.join.remote(
            group_id, gang.gang_id, gang.rank, gang.world_size, self._replica_id, labels)
        self._link.start()  # kept across the coordinator's restarts
        try:  # from here on this replica holds a rank: a failure gives it back at once
            await self._roll.take_settings()  # the engine settings the coordinator holds now
            app = self._app
            await asyncio.to_thread(release_leftovers)  # what killed replicas left here
            from engram_ray.private_dirs import private_dir
            from engram_ray.tables.slice_holder import SliceHolder
            # The coordinator made the generation's folder on its own node: on this node too
            # (0700, or checked), for the holder's socket and a one-host group's rendezvous.
            private_dir(a["store_dir"], "peer_group_store generation folder")
            self._holder = SliceHolder(a["store_dir"], a["generation"], a["member_rank"],
                                       a.get("holder_token"))
            await self._start_member(a)
            self.engram_metrics.set_group(a["generation_index"], True,
                                          rendezvous_seconds=time.perf_counter() - joined_at)
            await self._member_engine.started()
            self._link.ready_at = time.time()
            await self._coordinator.member_ready.remote(self._replica_id, own_actor(),
                                                        self._roll.version)
            # Watched from here: a member of a gang started beside a serving one whose engine
            # dies before the takeover breaks that gang (the serving one goes on).
            self._member_engine.start_watching()
            await self._link.take_over_when_drained(
                current_rollout(self).drain_timeout_s + 2 * app.deployment.rendezvous_timeout_s)
            self._link.start_returned = True
        except BaseException as exc:
            logger.error("engram-ray: replica failed to start: %s: %s", type(exc).__name__, exc)
            await self._leave()
            death = self._member_engine.find_death("while starting")
            if death is None:
                raise
            raise EngineDiedError(death.line()) from None

    def _replica(self) -> tuple[str, object, dict]:
        """(Serve replica id, its gang context, its node's labels)."""
        import ray
        from ray import serve

        context = serve.get_replica_context()
        if context.gang_context is None:
            raise EngramRayError("an engram-ray engine runs only in a peer-group gang "
                                 "(engram_ray.serve.app:build_group sets gang_scheduling_config)")
        return (context.replica_id.unique_id, context.gang_context,
                ray.get_runtime_context().get_node_labels() or {})

    async def _start_member(self, a: dict) -> None:
        """With rank `a`: engine settings, metrics endpoint and target, then the engine."""
        import ray

        app = self._app
        identity = EngineIdentity(app.serving.model_id, f"{a['group_id']}-r{a['member_rank']}",
                                  a["group_id"], a["member_rank"])
        self._model_target_file = os.path.join(
            tempfile.gettempdir(), "engram-ray", "model-targets", f"{self._replica_id}.json")
        # Fixed ports (serving.metrics_port > 0): base + 2 * this engine's slot on its node.
        self._node_id = ray.get_runtime_context().get_node_id()
        self._metrics_slot = slot = await self._coordinator.metrics_slot.remote(
            self._replica_id, self._node_id)
        settings = peer_group_settings(a, getattr(self, "dp_rank", 0),
                                       holders=getattr(self, "_holder", None) is not None)
        self._member_engine.additional = {**settings.to_additional_config(), PROCESS_METRICS_KEY: {
            **identity.labels(), "bind_address": app.serving.metrics_bind_address,
            "advertise_host": ray.util.get_node_ip_address(),
            "target_file": self._model_target_file,
            "port": metrics_port(app.serving.metrics_port, slot, "model")}}
        # The app's engine arguments, the ones this replica adds and the KV-cache probe (the
        # replica reads the workers' exact KV-cache bytes: engram_ray.serve.member.kv_cache), set
        # in LLMConfig and its cached engine config alike (`MemberEngine.set_kwargs`).
        self._member_engine.set_kwargs(app)
        # Table, host and gain bytes are not set from the plan here: the model process
        # reports what its tables really allocated (an engine that never got its peer-group
        # settings then shows no split instead of the planned one).
        self.engram_metrics = EngineMetrics(identity)
        self.engram_metrics.set_group(a["generation_index"], False)
        self._metrics_server = MetricsServer([self.engram_metrics.registry],
                                             app.serving.metrics_bind_address,
                                             metrics_port(app.serving.metrics_port, slot,
                                                          "replica"),
                                             advertise_host=ray.util.get_node_ip_address())
        await self._link.register_target(self._replica_id, self._metrics_server.target,
                                         self._target_labels("replica"))
        self._member_engine.watch = EngineWatch(identity.engine, self._replica_id, deaths_dir(
            app.deployment.peer_group_store, app.deployment.name))
        with recording_segments(self._replica_id):  # a death while starting too
            await super().start()

    async def _report_broken(self, reason: str) -> None:
        if self._reported_broken:
            return
        self._reported_broken = True
        self._link.lost_reason = reason
        try:
            await self._coordinator.report_broken.remote(self._replica_id, reason)
        except Exception as exc:  # the coordinator's own watch still finds the replica
            logger.error("engram-ray: could not report %s to the coordinator: %s", reason, exc)

    async def _register_model_process_target(self) -> None:
        """The model process's lookup metrics endpoint, if it started one
        (`engram_ray.metrics.exposition.start_process_metrics`). The file only hands the
        address over: removed once read, so no replica leaves one behind."""
        if os.path.exists(self._model_target_file):
            with open(self._model_target_file) as f:
                target = json.load(f)["target"]
            os.unlink(self._model_target_file)
            await self._link.register_target(f"{self._replica_id}/model", target,
                                             self._target_labels("model"))

    def _target_labels(self, endpoint: str) -> dict:
        """Labels of one of this engine's Prometheus targets: `endpoint` (its port name with
        fixed ports, else 'replica' or 'model') and, for relabeling only, the engine's identity
        as `__meta_engram_*` (its series carry model, engine, peer_group and rank already;
        target labels of those names would turn them into exported_*)."""
        a, slot = self._assignment, self._metrics_slot
        return {"endpoint": port_name(slot, endpoint) if self._app.serving.metrics_port
                else endpoint, "__meta_engram_slot": str(slot),
                "__meta_engram_peer_group": a["group_id"],
                "__meta_engram_rank": str(a["member_rank"])}

    async def _attach_stat_logger(self) -> None:
        """KV-cache capacity (`self.kv_cache_capacity`, its source in the replica's log) and
        the stat logger that turns vLLM's usage into headroom."""
        client = getattr(self.engine, "_engine_client", None)
        manager = getattr(client, "logger_manager", None)
        if client is None:
            return
        self.kv_cache_capacity = capacity = await engine_capacity(client)
        self.engram_metrics.set_kv_cache(capacity.capacity_bytes, capacity.capacity_tokens, 0.0)
        if manager is not None:
            manager.stat_loggers.append(EngramStatLogger(
                self.engram_metrics, capacity.capacity_bytes, capacity.capacity_tokens))

    async def check_health(self) -> None:
        restarts, engine = self._restarts, self._member_engine
        if restarts.error is not None:
            raise EngineDiedError(restarts.error)
        if restarts.is_restarting or (getattr(engine.client, "errored", False)
                                      and restarts.can_restart() and engine.is_watched()):
            return  # the engine restarts in place (or its watch is about to start it)
        try:
            await super().check_health()
        except Exception as exc:
            # A dead engine breaks the generation now; a check that fails and then passes
            # does not: only as many failures in a row as make Serve restart the replica.
            death = engine.find_death("while serving")
            self._failed_checks += 1
            if getattr(self, "_assignment", None) is not None and (
                    death is not None or self._failed_checks >= FAILED_CHECKS_TO_RESTART):
                await self._report_broken(f"health check failed {self._failed_checks} time(s) "
                                          f"in a row ({type(exc).__name__})")
            if death is None:
                raise
            raise EngineDiedError(death.line()) from None
        self._failed_checks = 0
        if getattr(self, "_assignment", None) is not None:
            self._link.tell_running()
        await engine.record_segments_if_due()

    async def completions(self, request, raw_request_info=None):
        return await self._answer(super().completions, request, raw_request_info)

    async def chat(self, request, raw_request_info=None):
        return await self._answer(super().chat, request, raw_request_info)

    async def _answer(self, call, request, raw_request_info):
        """A request, unless the member is retired or draining (`MemberRetiredError`: the
        ingress sends it to a member that serves), counted and tagged."""
        self._requests.refuse_if_retired(self._assignment)
        return await self._requests.counted(call, request, raw_request_info,
                                            self._assignment["generation"], self._roll.version)

    @classmethod
    def get_deployment_options(cls, llm_config):
        options = super().get_deployment_options(llm_config)
        # The group's gang options (engram_ray.serve.app) place it; Serve refuses a per-replica
        # strategy beside a gang.
        options.pop("placement_group_strategy", None)
        return options

    async def _leave(self) -> None:
        self._link.stop()
        target_file = getattr(self, "_model_target_file", None)
        if target_file is not None:  # a start that failed before the handover read it
            try:
                os.unlink(target_file)
            except FileNotFoundError:
                pass
        holder = getattr(self, "_holder", None)
        if holder is not None:
            holder.close()
            self._holder = None
            _remove_if_empty(self._assignment["store_dir"])
        server = getattr(self, "_metrics_server", None)
        if server is not None:
            server.stop()
            self._metrics_server = None
        try:  # a coordinator restarting answers within seconds; none: nothing to tell
            await asyncio.wait_for(self._coordinator.leave.remote(self._replica_id),
                                   LEAVE_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - its watch finds this replica gone anyway
            pass

    async def __del__(self):
        """Serve stops the replica (its requests drained): the engine first, within Serve's
        graceful shutdown, then the coordinator told (at most `LEAVE_TIMEOUT_S`). Told first,
        a coordinator restarting held the stop past Serve's 20 s and orphaned the engine."""
        link = getattr(self, "_link", None)
        if link is not None:
            link.stop()
        try:
            await super().__del__()
        finally:  # Serve's own stop leaves the engine running
            engine = getattr(self, "_member_engine", None)
            end_engine(engine and engine.client, engine and engine.processes)
            if getattr(self, "_coordinator", None) is not None:
                await self._leave()


def _remove_if_empty(folder: str) -> None:
    """A generation's folder on this node, once its last member here left (the coordinator
    removes the one on its own node whole)."""
    try:
        os.rmdir(folder)
    except OSError:
        pass


class EngramLLMServer(EngramServerMixin, LLMServer):
    """One engine per replica (TP=1, PP=1, no data parallelism)."""


class EngramDPServer(EngramServerMixin, DPServer):
    """One data-parallel rank per replica (DEP2: data-parallel gangs of 2 with expert
    parallelism), nested in its peer group's gang: peer rank r is DP rank r % D of DP gang
    r // D, so a DP gang never straddles two peer groups.

    NOTES: `DPServer.__init__` takes the DP rank, size and gang from the Serve gang, which here
    is the whole peer group; this constructor does what it does (DP master through
    `GangMasterInfoRegistry`, the replica's bundle for vLLM) for the nested DP gang."""

    async def __init__(self, llm_config, *, engine_cls=None, model_downloader=None):
        from ray import serve
        from ray.llm._internal.serve.serving_patterns.data_parallel.dp_server import (
            TIMEOUT_SECONDS)

        from engram_ray.serve.member.dp_gang import dp_gang_id, meet_dp_master

        gang = serve.get_replica_context().gang_context
        self.dp_size = llm_config.engine_kwargs["data_parallel_size"]
        self.dp_rank = gang.rank % self.dp_size
        self.gang_id = dp_gang_id(gang.gang_id, gang.rank // self.dp_size)
        address, port = await meet_dp_master(self.gang_id, self.dp_rank, TIMEOUT_SECONDS)
        llm_config.update_engine_kwargs(data_parallel_rank=self.dp_rank,
                                        data_parallel_address=address,
                                        data_parallel_rpc_port=port)
        # Serve puts peer rank r on bundles [r * B, (r + 1) * B) of the gang's group.
        num_bundles = len(llm_config.get_engine_config().placement_bundles)
        os.environ["VLLM_RAY_BUNDLE_INDICES"] = ",".join(
            str(gang.rank * num_bundles + i) for i in range(num_bundles))
        await LLMServer.__init__(self, llm_config, engine_cls=engine_cls,
                                 model_downloader=model_downloader)
