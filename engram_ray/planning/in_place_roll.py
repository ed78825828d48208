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

A turn is for one version: the members of a data-parallel gang restart with the settings of the
version their turn was given for (`settings_for`), even when a deploy changed the target
meanwhile (two engines of one DP group on two settings never form the group); the gang is
behind again afterwards and gets a turn for the new version.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the book is passed in; this module needs no import of it
    from engram_ray.planning.generations import GenerationBook


class InPlaceRoll:
    def __init__(self, version: str, settings: dict | None = None):
        self.version = version              # the settings every member should run
        self.settings: dict[str, dict] = {version: settings} if settings is not None else {}
        self.turn_versions: dict[str, str] = {}  # replica id -> version its turn is for
        self.member_versions: dict[str, str] = {}   # replica id -> version its engine runs
        self.turns: dict[str, str] = {}     # replica id -> group id: restarting for the roll
        self.stopped: dict | None = None    # {"replica_id", "reason", "at"} once it stopped
        self.started_at: float | None = None
        self.restarted: list[dict] = []     # {"replica_id", "group_id", "seconds"} per turn
        self._turn_started: dict[str, float] = {}

    def set_target(self, version: str, settings: dict | None = None) -> bool:
        """New settings (`settings`: the app config of `version`): True when they differ from
        the ones rolled out so far (the roll starts again, a stop forgotten)."""
        if settings is not None:
            self.settings[version] = settings
        if version == self.version:
            return False
        self.version, self.stopped, self.started_at = version, None, time.time()
        self.restarted = []
        self._keep_settings()
        return True

    def settings_for(self, version: str | None) -> tuple[str, dict | None]:
        """(version, app config) a member restarts with: `version`'s, while a turn for it is
        under way; else what a new engine starts with: the target's, or, while the roll is
        stopped, those the member it stopped at serves on again (a gang started meanwhile,
        after a lost replica, must not start on settings known not to start)."""
        if version is not None and version in self.settings:
            return version, self.settings[version]
        back = (self.stopped or {}).get("back_to")
        if back in self.settings:
            return back, self.settings[back]
        return self.version, self.settings.get(self.version)

    def turn_version(self, replica_id: str) -> str | None:
        return self.turn_versions.get(replica_id)

    def _keep_settings(self) -> None:
        """Settings of the target, of turns under way and of what members run only."""
        kept = {self.version, *self.turn_versions.values(), *self.member_versions.values()}
        self.settings = {v: s for v, s in self.settings.items() if v in kept}

    def running(self, replica_id: str, version: str | None) -> None:
        """The member's engine runs `version` (it started, restarted, or rejoined)."""
        if version is not None:
            self.member_versions[replica_id] = version
        group_id = self.turns.pop(replica_id, None)
        turn_version = self.turn_versions.pop(replica_id, None)
        started = self._turn_started.pop(replica_id, None)
        self._keep_settings()
        if group_id is not None and started is not None and version == turn_version:
            self.restarted.append({"replica_id": replica_id, "group_id": group_id,
                                   "seconds": round(time.time() - started, 1)})

    def rejoined(self, replica_id: str, version: str | None) -> None:
        """The member told a restarted coordinator that its engine runs `version`: a turn it
        holds goes on while it runs other settings (its engine is restarting for it)."""
        if replica_id in self.turns and version != self.turn_versions.get(replica_id):
            if version is not None:
                self.member_versions[replica_id] = version
            return
        self.running(replica_id, version)

    def forget(self, replica_id: str) -> None:
        self.member_versions.pop(replica_id, None)
        self.turns.pop(replica_id, None)
        self.turn_versions.pop(replica_id, None)
        self._turn_started.pop(replica_id, None)
        self._keep_settings()

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
        self.turn_versions[replica_id] = self.version
        self._turn_started[replica_id] = time.time()
        return True

    def join_turn(self, replica_id: str, group_id: str) -> None:
        """Member `replica_id` restarts in the turn another member of its data-parallel gang
        was given (a DP gang's engines restart together, with the same settings)."""
        if self.is_behind(replica_id) and replica_id not in self.turns:
            self.turns[replica_id] = group_id
            self.turn_versions[replica_id] = self.version
            self._turn_started[replica_id] = time.time()

    def stop(self, replica_id: str, reason: str, version: str | None = None) -> bool:
        """The member's engine would not start with the settings of its turn (`version`; it
        serves on the old ones again): no further turns until the settings change. A turn
        for settings that are no longer the target only ends (False): the target may start."""
        self.turns.pop(replica_id, None)
        turn_version = self.turn_versions.pop(replica_id, None)
        self._turn_started.pop(replica_id, None)
        self._keep_settings()
        if (version or turn_version or self.version) != self.version:
            return False
        self.stopped = {"replica_id": replica_id, "reason": reason, "at": time.time(),
                        "back_to": self.member_versions.get(replica_id)}
        return True

    def progress(self, member_ids) -> dict:
        """{"version", "members", "done", "restarting", "stopped", "restarted"} over the
        members `member_ids` of the live generations."""
        members = sorted(member_ids)
        done = [r for r in members if not self.is_behind(r)]
        return {"version": self.version, "members": len(members), "done": len(done),
                "restarting": sorted(self.turns), "stopped": self.stopped,
                "restarted": list(self.restarted)}


def take_turn(roll: InPlaceRoll, book: GenerationBook, replica_id: str, running: str,
              mode: str, max_groups_at_once: int) -> tuple[str | None, bool]:
    """(the settings version member `replica_id`, whose engine runs `running`, restarts with
    now, or None; whether the group's routing changed). A turn marks the member, and the rest
    of its data-parallel gang, restarting in `book` (its group routes around it) and in
    `roll` (no other member of the group, and no more than `max_groups_at_once` groups, get
    one until it is back). Turns of members whose gang is gone are dropped first."""
    roll.member_versions.setdefault(replica_id, running)
    live = book.member_ids()
    for stale in [r for r in roll.turns if r not in live]:
        roll.forget(stale)
    if mode != "in_place" or not roll.is_behind(replica_id):
        return None, False
    if replica_id in roll.turns:  # asked again before it reported: still its turn
        return roll.turn_version(replica_id) or roll.version, False
    group_id = book.whole_group_of(replica_id)
    if group_id is None or not roll.next_turn(replica_id, group_id, True, max_groups_at_once):
        return None, False
    changed = book.member_restarting(replica_id, f"settings {roll.version} rolling out: "
                                                 "engine restarts in place") is not None
    for peer in book.dp_peers(replica_id):  # a DP gang restarts whole
        roll.join_turn(peer, group_id)
    return roll.version, changed
