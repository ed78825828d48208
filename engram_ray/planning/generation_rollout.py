"""A rolling change in the generation book (`engram_ray.planning.generations`). Pure.

`serving.rollout.mode: beside`: Serve starts a group's new gang next to the serving one. Its
first member opens the group's `next` generation (`GenerationBook.join`); once every member of
it is ready it takes over (`_promote`): the old generation retires (no new requests, its
members report what they still run) and the new one serves once Serve runs every member
(`member_running`). A new member ends its start (and so lets Serve stop the old gang) only
when `may_take_over`: its generation took over and the retired one drained. Groups take over
one at a time (a group taking over serves no request for that moment; the others do).
"""

from __future__ import annotations

import time


# A group that takes over serves no request until Serve runs its new members (a second or
# two, plus the old gang's drain): groups take over one at a time so that the others serve
# meanwhile. One stuck longer than this no longer holds the others back.
MAX_TAKEOVER_S = 300.0


class RolloutMixin:
    def _ready_to_take_over(self, group) -> None:
        """Every member of `group.next` is ready: it takes over now, or once no other group
        is taking over (`_take_over_next`)."""
        if not any(self._is_taking_over(g) for g in self.groups.values() if g is not group):
            self._promote(group)

    def _is_taking_over(self, group) -> bool:
        gen = group.current
        return (gen is not None and gen.took_over and gen.broken is None
                and not gen.is_serving(self.config.peer_group_size)
                and time.time() - gen.took_over_at < MAX_TAKEOVER_S)

    def _take_over_next(self) -> None:
        """A group finished taking over (or stopped trying): the next ready one may."""
        if any(self._is_taking_over(g) for g in self.groups.values()):
            return
        size = self.config.peer_group_size
        waiting = [g for g in self.groups.values()
                   if g.next is not None and len(g.next.ready_at) == size]
        if waiting:
            self._promote(min(waiting, key=lambda g: max(g.next.ready_at.values())))

    def _promote(self, group) -> None:
        """`group.next` takes over; `current` retires (drains)."""
        new, old = group.next, group.current
        new.took_over, new.took_over_at, old.retired_at = True, time.time(), time.time()
        group.current, group.next, group.retired = new, None, old

    def member_running(self, replica_id: str) -> bool:
        """Serve runs member `replica_id` (its start returned): True when that made a
        generation that took over serve."""
        for group in self.groups.values():
            gen = group.current
            rank = gen.rank_of(replica_id) if gen else None
            if rank is not None and rank not in gen.running:
                gen.running.add(rank)
                took_over = gen.took_over and gen.is_serving(self.config.peer_group_size)
                if took_over:
                    self._take_over_next()
                return took_over
        return False

    def is_retired(self, replica_id: str) -> bool:
        return any(g.retired is not None and g.retired.rank_of(replica_id) is not None
                   for g in self.groups.values())

    def report_in_flight(self, replica_id: str, num_requests: int) -> None:
        """What a retired member still runs, counted after it knew it was retired (it takes
        no new request from then on, so the count only falls)."""
        for group in self.groups.values():
            rank = group.retired.rank_of(replica_id) if group.retired else None
            if rank is not None:
                group.retired.in_flight[rank] = num_requests

    def may_take_over(self, replica_id: str, drain_timeout_s: float) -> bool | None:
        """Member `replica_id` of a gang started beside a serving one may finish its start
        (then Serve stops the old gang): its generation took over and the retired one has no
        request left running (or `drain_timeout_s` passed). At once for any other member;
        None when no live generation holds it (its gang failed meanwhile: it must not run)."""
        for group in self.groups.values():
            if group.next is not None and group.next.rank_of(replica_id) is not None:
                return False  # not every member of its gang is ready yet
            gen, old = group.current, group.retired
            if gen is None or gen.rank_of(replica_id) is None:
                continue
            if not gen.took_over or old is None:
                return True
            drained = (len(old.in_flight) == len(old.members)
                       and not any(old.in_flight.values()))
            return drained or time.time() - old.retired_at >= drain_timeout_s
        return None
