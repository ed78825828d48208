"""Groups whose NVLink domain is lost, and when they are due to be placed again. Pure: no Ray.

A group runs where its Serve deployment's bundle label selector points (`selector`: the
`Domain.selector` it was given). Its domain is lost while no alive domain answers to that
selector with room for the whole group (`num_total_slots`, free or not: its nodes died or
left). A group lost for `grace_s` in a row is due (a node that restarts comes back sooner and
keeps its groups); a group just placed again waits another `grace_s` before it can be due
again (Serve takes a moment to show the new selector).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engram_ray.planning.grouping import Domain


@dataclass
class LostDomainWatch:
    grace_s: float
    lost_since: dict[str, float] = field(default_factory=dict)  # group id -> first seen lost

    def due(self, selectors: dict[str, dict], domains: list[Domain], peer_group_size: int,
            now: float) -> list[str]:
        """Group ids (of `selectors`: group id -> its deployment's selector) lost for
        `grace_s` or more at time `now`."""
        alive = [d.selector for d in domains
                 if d.num_total_slots is None or d.num_total_slots >= peer_group_size]
        for group_id in [g for g in self.lost_since if g not in selectors]:
            del self.lost_since[group_id]  # dropped from the application
        due = []
        for group_id, selector in sorted(selectors.items()):
            if selector in alive:
                self.lost_since.pop(group_id, None)
            elif now - self.lost_since.setdefault(group_id, now) >= self.grace_s:
                due.append(group_id)
        return due

    def placed(self, group_id: str, now: float) -> None:
        """`group_id` was given another domain at `now`."""
        self.lost_since[group_id] = now
