"""The state of one peer group's generations (`engram_ray.planning.generations`). Pure."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field


@dataclass
class Generation:
    index: int
    generation: str
    gang_id: str
    store_dir: str
    # Slice holders answer only requests carrying it (engram_ray.tables.slice_holder): drawn
    # per generation, given to its members with their assignment, in no status or folder.
    holder_token: str = field(default_factory=lambda: secrets.token_hex(16), repr=False)
    members: dict = field(default_factory=dict)   # rank -> {"replica_id", "node_labels"}
    started_at: float = field(default_factory=time.time)
    ready_at: dict = field(default_factory=dict)   # rank -> wall time its engine served
    broken: str | None = None                      # why it stopped serving, for good
    broken_at: float | None = None
    restarting: dict = field(default_factory=dict)  # rank -> {"reason", "since", "epoch"}
    dp_epochs: dict = field(default_factory=dict)   # DP gang index -> restarts in place so far
    restarts: list = field(default_factory=list)    # {"rank", "reason", "since", "ready_at"}
    # A gang that took over beside its predecessor (a rolling change) serves once Serve runs
    # every member (its start returned; `running`): until then Serve still routes to the old.
    took_over: bool = False
    took_over_at: float | None = None
    running: set = field(default_factory=set)
    retired_at: float | None = None                 # replaced by a rolling change: draining
    in_flight: dict = field(default_factory=dict)   # rank -> requests running (retired)
    rebuilt_as: str | None = None  # the role it was rebuilt in after a coordinator restart
    # Rebuilt current from a member of a gang that started beside a serving one, which has not
    # rejoined yet: the rebuild is not complete until it has (or its wait ends).
    awaits_serving: bool = False

    def is_serving(self, size: int) -> bool:
        return (self.broken is None and len(self.ready_at) == size
                and len(self.restarting) < size
                and (not self.took_over or len(self.running) == size))

    def rank_of(self, replica_id: str) -> int | None:
        return next((rank for rank, m in self.members.items()
                     if m["replica_id"] == replica_id), None)

    def serving_members(self) -> list[str]:
        """Replica ids of the members that take requests now."""
        return sorted(m["replica_id"] for rank, m in self.members.items()
                      if rank in self.ready_at and rank not in self.restarting)


@dataclass
class GroupRecord:
    group_id: str
    domain_id: str
    current: Generation | None = None
    next: Generation | None = None      # a gang starting beside `current` (a rolling change)
    retired: Generation | None = None   # the one `next` replaced, draining until it stops
    history: list = field(default_factory=list)    # (index, gang id, seconds it lived)

    def generations(self) -> list[Generation]:
        return [g for g in (self.current, self.next, self.retired) if g is not None]
