"""The coordinator's series: what no engine can say, because it is about the deployment as a
whole or about engines that are gone. Read from the coordinator's book at each scrape (a
prometheus-client collector over `snapshot()`), served on the coordinator's own endpoint
(`exposition.TargetsServer`: `serving.http_sd_port` on the head, beside `/targets`, else a free
port) and listed among the targets with `endpoint="coordinator"`.

Every series carries `model` and `deployment` (`deployment.name`):

    engram_groups_configured              serving.num_peer_groups
    engram_groups_serving                 groups the ingress sends requests to now
    engram_groups_rolling                 groups with a new gang starting beside the serving
                                          one, or an old one draining (rollout beside/restart)
    engram_roll_in_progress               1 while a rolling change has members to go
    engram_roll_members                   members of the live generations
    engram_roll_members_done              of those, members whose engine runs the latest
                                          settings (progress: done / members)
    engram_roll_stopped                   1 when the in-place roll stopped: a member's engine
                                          would not start with the new settings
    engram_coordinator_start_time_seconds when this coordinator process started (Unix time)
    engram_coordinator_restarted          1 when this process is a restart (Ray restarted the
                                          coordinator after its process died), 0 at first start
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily


@dataclass(frozen=True)
class CoordinatorSnapshot:
    groups_configured: int
    groups_serving: int
    groups_rolling: int
    roll_members: int
    roll_members_done: int
    roll_stopped: bool
    start_time: float
    restarted: bool

    @property
    def roll_in_progress(self) -> bool:
        return bool(self.groups_rolling) or (self.roll_members_done < self.roll_members
                                             and not self.roll_stopped)


SERIES = {
    "engram_groups_configured": ("Peer groups the deployment asks for (serving.num_peer_groups)",
                                 lambda s: s.groups_configured),
    "engram_groups_serving": ("Peer groups the ingress sends requests to now",
                              lambda s: s.groups_serving),
    "engram_groups_rolling": ("Peer groups with a new gang starting beside the serving one or "
                              "an old one draining", lambda s: s.groups_rolling),
    "engram_roll_in_progress": ("1 while a rolling change has members to go",
                                lambda s: int(s.roll_in_progress)),
    "engram_roll_members": ("Members of the live generations", lambda s: s.roll_members),
    "engram_roll_members_done": ("Members whose engine runs the latest settings",
                                 lambda s: s.roll_members_done),
    "engram_roll_stopped": ("1 when the in-place roll stopped on a member whose engine would "
                            "not start with the new settings", lambda s: int(s.roll_stopped)),
    "engram_coordinator_start_time_seconds": ("When this coordinator process started (Unix "
                                              "time)", lambda s: s.start_time),
    "engram_coordinator_restarted": ("1 when this coordinator process is a restart after its "
                                     "predecessor died", lambda s: int(s.restarted)),
}


class CoordinatorMetrics:
    """A registry whose collector reads `snapshot()` (a CoordinatorSnapshot) at each scrape."""

    def __init__(self, model: str, deployment: str, snapshot):
        self.labels = {"model": model, "deployment": deployment}
        self._snapshot = snapshot
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def collect(self):
        snap = self._snapshot()
        for name, (doc, value) in SERIES.items():
            family = GaugeMetricFamily(name, doc, labels=list(self.labels))
            family.add_metric(list(self.labels.values()), float(value(snap)))
            yield family


def snapshot_of(config, book, roll, start_time: float, restarted: bool) -> CoordinatorSnapshot:
    """The coordinator's state as series: `config` its ServeAppConfig, `book` its
    GenerationBook, `roll` its InPlaceRoll (called under the coordinator's lock)."""
    progress = roll.progress(book.member_ids())
    return CoordinatorSnapshot(
        groups_configured=config.serving.num_peer_groups,
        groups_serving=sum(1 for row in book.routing().values() if row["serving"]),
        groups_rolling=sum(1 for g in book.groups.values() if g.next or g.retired),
        roll_members=progress["members"], roll_members_done=progress["done"],
        roll_stopped=progress["stopped"] is not None, start_time=start_time,
        restarted=restarted)
