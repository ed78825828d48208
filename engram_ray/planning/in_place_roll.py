"""A changed config rolled out by restarting engines in place (`serving.rollout.mode:
in_place`): which member restarts next. Pure: no Ray.

The coordinator holds the engine settings the members should run (`config_version` of
`engram_ray.serve.settings.config_change`, a hash of the `IN_PLACE_SETTINGS`). Every member
reports the version its engine runs (at join, ready, rejoin) and asks every `MEMBER_CHECK_S`
whether it is its turn (`next_turn`). A turn goes to a member whose engine runs another version when:

    its group serves, every member of its generation ready, none restarting (never two
    members of one group at once, whether for a roll or an engine's death)
    fewer than `max_groups_at_once` groups have a member restarting for the roll
    the roll has not stopped (a member's new engine would not start: `stop`)

The member drains, restarts its engine with the new settings and reports ready with the new
version (`running`), or, when the new engine fails, restarts on the old settings and the roll
stops there (`stop`) until the next change of settings.
"""

from __future__ import annotations

import time


class InPlaceRoll:
    def __init__(self, version: str):
        self.version = version              # the settings every member should run
        self.member_versions: dict[str, str] = {}   # replica id -> version its engine runs
        self.turns: dict[str, str] = {}     # replica id -> group id: restarting for the roll
        self.stopped: dict | None = None    # {"replica_id", "reason", "at"} once it stopped
        self.started_at: float | None = None
        self.restarted: list[dict] = []     # {"replica_id", "group_id", "seconds"} per turn
        self._turn_started: dict[str, float] = {}

    def set_target(self, version: str) -> bool:
        """New settings: True when they differ from the ones rolled out so far (the roll
        starts again, a stop forgotten)."""
        if version == self.version:
            return False
        self.version, self.stopped, self.started_at = version, None, time.time()
        self.restarted = []
        return True

    def running(self, replica_id: str, version: str | None) -> None:
        """The member's engine runs `version` (it started, restarted, or rejoined)."""
        if version is not None:
            self.member_versions[replica_id] = version
        group_id = self.turns.pop(replica_id, None)
        started = self._turn_started.pop(replica_id, None)
        if group_id is not None and started is not None and version == self.version:
            self.restarted.append({"replica_id": replica_id, "group_id": group_id,
                                   "seconds": round(time.time() - started, 1)})

    def forget(self, replica_id: str) -> None:
        self.member_versions.pop(replica_id, None)
        self.turns.pop(replica_id, None)
        self._turn_started.pop(replica_id, None)

    def is_behind(self, replica_id: str) -> bool:
        return self.member_versions.get(replica_id, self.version) != self.version

    def next_turn(self, replica_id: str, group_id: str, group_is_whole: bool,
                  max_groups_at_once: int) -> bool:
        """Whether member `replica_id` of `group_id` restarts its engine now (then it is
        counted as restarting for the roll until `running`). `group_is_whole`: its group
        serves with every member ready and none restarting."""
        if replica_id in self.turns:
            return True  # asked again before it reported (a lost answer)
        if self.stopped is not None or not self.is_behind(replica_id) or not group_is_whole:
            return False
        if group_id in self.turns.values():
            return False
        if len(set(self.turns.values())) >= max_groups_at_once:
            return False
        self.turns[replica_id] = group_id
        self._turn_started[replica_id] = time.time()
        return True

    def join_turn(self, replica_id: str, group_id: str) -> None:
        """Member `replica_id` restarts in the turn another member of its data-parallel gang
        was given (a DP gang's engines restart together)."""
        if self.is_behind(replica_id) and replica_id not in self.turns:
            self.turns[replica_id] = group_id
            self._turn_started[replica_id] = time.time()

    def stop(self, replica_id: str, reason: str) -> None:
        """The member's engine would not start with the new settings (it serves on the old
        ones again): no further turns until the settings change."""
        self.turns.pop(replica_id, None)
        self._turn_started.pop(replica_id, None)
        self.stopped = {"replica_id": replica_id, "reason": reason, "at": time.time()}

    def progress(self, member_ids) -> dict:
        """{"version", "members", "done", "restarting", "stopped", "restarted"} over the
        members `member_ids` of the live generations."""
        members = sorted(member_ids)
        done = [r for r in members if not self.is_behind(r)]
        return {"version": self.version, "members": len(members), "done": len(done),
                "restarting": sorted(self.turns), "stopped": self.stopped,
                "restarted": list(self.restarted)}
