"""Peer-group settings as they reach a vLLM engine through `additional_config`.

    additional_config = {"engram_peer_group": {"size": P, "store": DIR, "rank": r,
                                               "generation": G}}

(the upstream proposal's `peer_group_size` / `peer_group_store`, plus this engine's rank and the
coordinator's generation id). Optional keys: `timeout_s` (rendezvous wait), `backend`
("shm" on CPU, "cuda" on GPUs), `cross_node` (the group spans hosts) and `handle_type`
("fabric" or "posix_fd": how slices are exported; a cross-node group needs "fabric").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from engram_ray.errors import ConfigError

ADDITIONAL_CONFIG_KEY = "engram_peer_group"
BACKENDS = ("shm", "cuda")
HANDLE_TYPES = ("fabric", "posix_fd")
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
        if self.handle_type is not None and self.handle_type not in HANDLE_TYPES:
            raise ConfigError(f"{field}.handle_type", f"is {self.handle_type!r}",
                              f"one of {', '.join(HANDLE_TYPES)}")
        if self.cross_node and self.handle_type != "fabric":
            raise ConfigError(
                f"{field}.handle_type", f"is {self.handle_type!r} for a cross-node group",
                "'fabric': peers on other hosts can only map CUDA FABRIC handles (needs an IMEX "
                "channel); keep the group inside one host or enable FABRIC handles")
        self.to_spec()  # size, rank, store, generation and timeout checks

    def to_spec(self):
        """The `engram_ray.table.PeerGroupSpec` of this engine."""
        from engram_ray.table import PeerGroupSpec
        return PeerGroupSpec(size=self.size, rank=self.rank, store_dir=self.store,
                             generation=str(self.generation), timeout_s=self.timeout_s)

    def to_additional_config(self) -> dict:
        return {ADDITIONAL_CONFIG_KEY: {k: v for k, v in asdict(self).items() if v is not None}}

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
