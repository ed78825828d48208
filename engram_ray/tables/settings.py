"""One engine's place in a peer group: the one settings type from the coordinator's assignment
through vLLM's `additional_config` to the tables.

    additional_config = {"engram_peer_group": {"size": P, "store_dir": DIR, "rank": r,
                                               "generation": G}}

The deployment config (`engram_ray.config.DeploymentConfig`, the YAML) holds what every member
of every group shares (`peer_group_size`, the stores' root `peer_group_store`, `table_backend`,
`handle_type`, `rendezvous_timeout_s`); the coordinator adds each member's `rank`, its
generation id and that generation's store folder `store_dir` (inside `peer_group_store`,
`engram_ray.planning.assignment.generation_store_dir`); the Serve replica hands the result to
its engine (`to_additional_config`) and the engine opens its tables with it (`for_engine`).

In a data-parallel deployment (DP > 1, e.g. DEP) every DP rank is one member: `rank` is the
member of DP rank 0 and DP rank d is member `rank + d` (`for_dp_rank`); `size` counts every DP
rank of every deployment in the group. Optional: `timeout_s` (rendezvous wait), `backend`
("shm" on CPU, "cuda" on GPUs), `cross_node` (the group spans hosts) and `handle_type`
("fabric" or "posix_fd": how slices are exported; a cross-node group needs "fabric"). With
`handle_type` the cuda backend offers only that type and fails at start-up if this GPU cannot
use it, and every member of the group must request the same; without it the group picks the
first type every member can use (FABRIC, then POSIX FDs on one host). `handle_type` names CUDA
handle types, so it is refused with backend "shm" (whose slices travel as shared-memory files).
`holders` (the Serve replica sets it): every member's replica runs a slice holder
(`engram_ray.tables.slice_holder`); the engine hands it its filled slices, and an engine that
restarts inside its replica maps every member's slices from their holders instead of filling
its own and meeting the group again.
"""

from __future__ import annotations

import re
from dataclasses import MISSING, asdict, dataclass, fields, replace

from engram_ray.errors import ConfigError
from engram_ray.tables import BACKENDS
from engram_ray.tables.backends.handle_types import check_handle_request

ADDITIONAL_CONFIG_KEY = "engram_peer_group"
FIELD = f"additional_config.{ADDITIONAL_CONFIG_KEY}"  # how errors name these settings
_GENERATION = re.compile(r"[A-Za-z0-9._-]{1,64}")
_TOKEN = re.compile(r"[0-9a-f]{32}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class PeerGroupSettings:
    """One engine's place in a peer group (module doc); validated on construction, naming the
    field at fault."""

    size: int                   # P, members of the group
    store_dir: str              # this generation's store folder (inside peer_group_store)
    rank: int                   # 0 <= rank < size
    generation: str             # the coordinator's generation id ([A-Za-z0-9._-]{1,64})
    timeout_s: float = 300.0    # how long the rendezvous waits for every member
    backend: str = "shm"        # engram_ray.tables.BACKENDS
    cross_node: bool = False    # the group spans hosts: needs handle_type "fabric"
    handle_type: str | None = None  # cuda backend: "fabric" | "posix_fd", None: group picks
    holders: bool = False       # slices kept by holders in the replicas (module doc)
    holder_token: str | None = None  # the generation's holder token (slice_holder module doc)

    def __post_init__(self):
        for name in ("size", "rank"):
            if not _is_int(getattr(self, name)):
                raise ConfigError(f"{FIELD}.{name}", f"is {getattr(self, name)!r}", "an integer")
        if self.size < 1:
            raise ConfigError(f"{FIELD}.size", f"is {self.size}", "an integer >= 1")
        if not 0 <= self.rank < self.size:
            raise ConfigError(f"{FIELD}.rank", f"is {self.rank}", f"0 <= rank < {self.size}")
        if not isinstance(self.store_dir, str) or not self.store_dir:
            raise ConfigError(f"{FIELD}.store_dir", f"is {self.store_dir!r}",
                              "a directory path (a folder inside peer_group_store)")
        if not isinstance(self.generation, str) or not _GENERATION.fullmatch(self.generation):
            raise ConfigError(f"{FIELD}.generation", f"is {self.generation!r}",
                              "1-64 characters of letters, digits, '.', '_' or '-'")
        if (not isinstance(self.timeout_s, (int, float)) or isinstance(self.timeout_s, bool)
                or not self.timeout_s > 0):
            raise ConfigError(f"{FIELD}.timeout_s", f"is {self.timeout_s!r}",
                              "a positive number of seconds")
        if self.backend not in BACKENDS:
            raise ConfigError(f"{FIELD}.backend", f"is {self.backend!r}",
                              f"one of {', '.join(BACKENDS)}")
        if self.holder_token is not None and not _TOKEN.fullmatch(str(self.holder_token)):
            raise ConfigError(f"{FIELD}.holder_token", "is not 32 hex digits",
                              "the token the coordinator gave the generation")
        if not isinstance(self.holders, bool):
            raise ConfigError(f"{FIELD}.holders", f"is {self.holders!r}", "true or false")
        check_handle_request(self.handle_type, self.cross_node, FIELD)
        if self.backend == "shm" and self.handle_type is not None:
            raise ConfigError(
                f"{FIELD}.handle_type", f"is {self.handle_type!r} with backend 'shm'",
                "no handle_type: 'fabric' and 'posix_fd' are CUDA handle types; set backend "
                "'cuda' for GPU tables, or drop handle_type (shm slices are shared-memory files)")

    def for_dp_rank(self, dp_rank: int, dp_size: int) -> "PeerGroupSettings":
        """Settings of the engine of DP rank `dp_rank` (member `rank + dp_rank`)."""
        if dp_size <= 1:
            return self
        if self.rank + dp_size > self.size:
            raise ConfigError(
                f"{FIELD}.rank", f"is {self.rank} for a deployment of data_parallel_size "
                f"{dp_size} in a group of {self.size}",
                "rank + data_parallel_size <= size (DP rank d is member rank + d)")
        return replace(self, rank=self.rank + dp_rank)

    def to_additional_config(self) -> dict:
        return {ADDITIONAL_CONFIG_KEY: {k: v for k, v in asdict(self).items() if v is not None}}

    @classmethod
    def for_engine(cls, vllm_config) -> "PeerGroupSettings | None":
        """This engine's settings from its VllmConfig (additional_config + DP rank)."""
        settings = cls.from_additional_config(vllm_config.additional_config)
        if settings is None:
            return None
        parallel = vllm_config.parallel_config
        return settings.for_dp_rank(parallel.data_parallel_rank, parallel.data_parallel_size)

    @classmethod
    def from_additional_config(cls, additional_config) -> "PeerGroupSettings | None":
        """Settings from vLLM's `additional_config` (dict or None); None: no peer group."""
        raw = (additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
        if raw is None:
            return None
        keys = [f.name for f in fields(cls)]
        required = [f.name for f in fields(cls) if f.default is MISSING]
        if not isinstance(raw, dict):
            raise ConfigError(FIELD, f"is {raw!r}", f"an object {{{', '.join(required)}}}")
        unknown = sorted(set(raw) - set(keys))
        if unknown:
            raise ConfigError(f"{FIELD}.{unknown[0]}", "is not a known key",
                              f"keys among {', '.join(keys)}")
        missing = [key for key in required if key not in raw]
        if missing:
            raise ConfigError(f"{FIELD}.{missing[0]}", "is missing",
                              f"{', '.join(required[:-1])} and {required[-1]}")
        return cls(**raw)
