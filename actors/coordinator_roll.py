"""The coordinator's calls for an in-place roll of engine settings (`serving.rollout.mode:
in_place`): a member's turn (`member_check` asks `_roll_turn_locked`), the settings it starts
with (`member_settings`), a roll that failed (`roll_failed`), its progress (`roll_status`), and
a deploy the build refused (`refuse`, `refusal`). The bookkeeping is
`engram_ray.planning.in_place_roll.InPlaceRoll` (`self.roll`); mixed into
`actors/coordinator.Coordinator`, whose lock, book and config these use.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("engram_ray.actors.coordinator")


class InPlaceRollMixin:
    def _roll_turn_locked(self, replica_id: str, running: str) -> str | None:
        """The settings version member `replica_id` restarts its engine with now, if it is
        its turn (`InPlaceRoll.next_turn`); its group then routes around it."""
        rollout = self.config.serving.rollout
        self.roll.member_versions.setdefault(replica_id, running)
        live = self.book.member_ids()
        for stale in [r for r in self.roll.turns if r not in live]:  # gang gone meanwhile
            self.roll.forget(stale)
        if rollout.mode != "in_place" or not self.roll.is_behind(replica_id):
            return None
        if replica_id in self.roll.turns:
            return self.roll.version  # asked again before it reported: still its turn
        group_id = self.book.whole_group_of(replica_id)
        if group_id is None or not self.roll.next_turn(replica_id, group_id, True,
                                                       rollout.max_groups_at_once):
            return None
        if self.book.member_restarting(replica_id, f"settings {self.roll.version} rolling "
                                                   "out: engine restarts in place"):
            self._routing_changed_locked()
        for peer in self.book.dp_peers(replica_id):  # a DP gang restarts whole
            self.roll.join_turn(peer, group_id)
        logger.warning("engram-ray: %s member %s restarts its engine with settings %s "
                       "(in-place roll)", group_id, replica_id, self.roll.version)
        return self.roll.version

    def member_settings(self) -> tuple[str, dict]:
        """(settings version, app config) the members' engines should run."""
        from engram_ray.serve.settings.config_change import config_version

        with self._lock:
            return config_version(self.made_with[0]), self.made_with[0]

    def roll_failed(self, replica_id: str, reason: str) -> None:
        """Member `replica_id`'s engine would not start with the rolled-out settings (it
        serves on the old ones again): the roll stops at it."""
        with self._lock:
            self.roll.stop(replica_id, reason)
        logger.error("engram-ray: the in-place roll of %s's settings %s stopped at member %s "
                     "(it serves on its old settings): %s; deploy settings that start, or the "
                     "old ones", self.deployment_name, self.roll.version, replica_id, reason)

    def roll_status(self) -> dict:
        """The in-place roll's progress (`InPlaceRoll.progress`) and the mode."""
        self._wait_rebuilt()
        with self._lock:
            return {"mode": self.config.serving.rollout.mode,
                    **self.roll.progress(self.book.member_ids()),
                    "member_versions": dict(self.roll.member_versions)}

    def refuse(self, group_settings: dict, reason: str) -> None:
        """The front door's build refused a deploy whose groups run `group_settings`."""
        with self._lock:
            self._refusal = (group_settings, reason)

    def refusal(self, group_settings: dict) -> str | None:
        """Why the deploy whose groups run `group_settings` was refused, if it was."""
        with self._lock:
            if self._refusal is not None and self._refusal[0] == group_settings:
                return self._refusal[1]
            return None
