"""Engines that only record where they run: the real engram-ray replica classes (their join
with the coordinator, gang context and DP nesting) with vLLM left out. Each replica writes
one JSON file into `records_dir(peer_group_store)`: its replica id, group, gang, ranks, node.
Used by tests/cpu/actors/test_placement.py through `engram_ray.serve.app.engram_applications(...,
server_cls)`."""

from __future__ import annotations

import json
import os

from engram_ray.metrics.engine import EngineIdentity, EngineMetrics
from engram_ray.serve.member.server import EngramDPServer, EngramLLMServer


def records_dir(peer_group_store: str) -> str:
    return peer_group_store.rstrip("/") + "-records"


class _Recording:
    async def _start_member(self, a: dict) -> None:
        import ray
        from ray import serve

        context = serve.get_replica_context()
        gang = context.gang_context
        record = {"replica_id": self._replica_id, "group_id": a["group_id"],
                  "domain_id": a["domain_id"], "generation": a["generation"],
                  "generation_index": a["generation_index"], "gang_id": gang.gang_id,
                  "rank": gang.rank, "world_size": gang.world_size,
                  "member_rank": a["member_rank"],
                  "dp_rank": getattr(self, "dp_rank", 0), "dp_size": getattr(self, "dp_size", 1),
                  "dp_gang_id": getattr(self, "gang_id", None),
                  "node_id": ray.get_runtime_context().get_node_id(),
                  "node_labels": ray.get_runtime_context().get_node_labels(),
                  "pid": os.getpid()}
        self._node_id = record["node_id"]  # a member's rejoin after a coordinator restart
        folder = records_dir(self._app.deployment.peer_group_store)
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{self._replica_id}.json"), "w") as f:
            json.dump(record, f)
        self._model_target_file = os.path.join(folder, "none")
        self.engram_metrics = EngineMetrics(EngineIdentity(
            "rec", f"{a['group_id']}-r{a['member_rank']}", a["group_id"], a["member_rank"]))

    async def check_health(self) -> None:
        return None

    async def __del__(self):
        pass


class RecordingServer(_Recording, EngramLLMServer):
    pass


class RecordingDPServer(_Recording, EngramDPServer):
    pass


def recording_class(args: dict):
    dp = args.get("serving", {}).get("data_parallel_size", 1)
    return RecordingDPServer if dp > 1 else RecordingServer


def build_recording_app(args: dict):
    """`import_path` of a `serve deploy` (declarative) of recording engines: the front door;
    the test puts tests/ on the application's PYTHONPATH (`runtime_env.env_vars`)."""
    from engram_ray.serve.app import build_front_door, refused_at_once

    with refused_at_once():
        return build_front_door(args, recording_class(args))


def build_recording_group(args: dict):
    """The groups' applications of `build_recording_app`."""
    from engram_ray.serve.app import build_group_app, refused_at_once

    with refused_at_once():
        return build_group_app(args, recording_class(args))
