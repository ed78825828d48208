"""Peer-group settings as they reach a vLLM engine through `additional_config`.

    additional_config = {"engram_peer_group": {"size": P, "store": DIR, "rank": r,
                                               "generation": G}}

(the upstream proposal's `peer_group_size` / `peer_group_store`, plus this engine's rank and the
coordinator's generation id). In a data-parallel deployment (DP > 1, e.g. DEP) every DP rank is
one member: `rank` is the member of DP rank 0 and DP rank d is member `rank + d`
(`for_dp_rank`); `size` counts every DP rank of every deployment in the group. Optional keys:
`timeout_s` (rendezvous wait), `backend` ("shm" on CPU, "cuda" on GPUs), `cross_node` (the
group spans hosts) and `handle_type` ("fabric" or "posix_fd": how slices are exported; a
cross-node group needs "fabric"). Both reach the backend through `to_spec`: with `handle_type`
the cuda backend offers only that type and fails at start-up if this GPU cannot use it, and
every member of the group must request the same; without it the group picks the first type
every member can use (FABRIC, then POSIX FDs on one host). `handle_type` names CUDA handle
types, so it is refused with backend "shm" (whose slices travel as shared-memory files).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from engram_ray.errors import ConfigError
from engram_ray.tables import BACKENDS
from engram_ray.tables.backends.handle_types import check_handle_request

ADDITIONAL_CONFIG_KEY = "engram_peer_group"
_REQUIRED = ("size", "store", "rank", "generation")
_OPTIONAL = ("timeout_s", "backend", "cross_node", "handle_type")


@dataclass(frozen=True)
class PeerGroupSettings:
    """One engine's place in a peer group; validated on construction."""

    size: int
    store: str
    rank: int
    generation: str | int
    timeout_s: float = 300.0
    backend: str = "shm"
    cross_node: bool = False
    handle_type: str | None = None

    def __post_init__(self):
        field = f"additional_config.{ADDITIONAL_CONFIG_KEY}"
        if self.backend not in BACKENDS:
            raise ConfigError(f"{field}.backend", f"is {self.backend!r}",
                              f"one of {', '.join(BACKENDS)}")
        check_handle_request(self.handle_type, self.cross_node, field)
        if self.backend == "shm" and self.handle_type is not None:
            raise ConfigError(
                f"{field}.handle_type", f"is {self.handle_type!r} with backend 'shm'",
                "no handle_type: 'fabric' and 'posix_fd' are CUDA handle types; set backend "
                "'cuda' for GPU tables, or drop handle_type (shm slices are shared-memory files)")
        self.to_spec()  # size, rank, store, generation and timeout checks

    def to_spec(self):
        """The `engram_ray.tables.table.PeerGroupSpec` of this engine."""
        from engram_ray.tables.table import PeerGroupSpec
        return PeerGroupSpec(size=self.size, rank=self.rank, store_dir=self.store,
                             generation=str(self.generation), timeout_s=self.timeout_s,
                             handle_type=self.handle_type, cross_node=self.cross_node)

    def for_dp_rank(self, dp_rank: int, dp_size: int) -> "PeerGroupSettings":
        """Settings of the engine of DP rank `dp_rank` (member `rank + dp_rank`)."""
        if dp_size <= 1:
            return self
        if self.rank + dp_size > self.size:
            raise ConfigError(
                f"additional_config.{ADDITIONAL_CONFIG_KEY}.rank",
                f"is {self.rank} for a deployment of data_parallel_size {dp_size} in a group of "
                f"{self.size}", f"rank + data_parallel_size <= size (DP rank d is member "
                "rank + d)")
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
        field = f"additional_config.{ADDITIONAL_CONFIG_KEY}"
        if not isinstance(raw, dict):
            raise ConfigError(field, f"is {raw!r}", "an object {size, store, rank, generation}")
        unknown = sorted(set(raw) - set(_REQUIRED) - set(_OPTIONAL))
        if unknown:
            raise ConfigError(f"{field}.{unknown[0]}", "is not a known key",
                              f"keys among {', '.join(_REQUIRED + _OPTIONAL)}")
        missing = [key for key in _REQUIRED if key not in raw]
        if missing:
            raise ConfigError(f"{field}.{missing[0]}", "is missing",
                              "size, store, rank and generation")
        return cls(**raw)
