"""`LiveMemberRouter`: Serve's request router of a peer group's deployment, sending requests
only to the members that serve (an engine restarting inside its replica gets none).

Serve runs a deployment's router in every process that holds a handle to it, here the
ingress; the members that serve are what that process's ingress last heard from the
coordinator (`engram_ray.serve.edge.ingress.live_replica_ids`, read at call time: Serve pickles this
module by value, so a module-level set here would be a copy). Among them it is Serve's own
power of two choices; before the ingress has heard anything, Serve's default over every
replica.
"""

from __future__ import annotations

import random

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter

ROUTER_PATH = "engram_ray.serve.edge.member_router:LiveMemberRouter"


class LiveMemberRouter(PowerOfTwoChoicesRequestRouter):
    async def choose_replicas(self, candidate_replicas, pending_request=None):
        from engram_ray.serve.edge.ingress import live_replica_ids

        live = live_replica_ids()
        if live is None:
            return await super().choose_replicas(candidate_replicas, pending_request)
        serving = [r for r in candidate_replicas if r.replica_id.unique_id in live]
        if not serving:
            # The group stopped serving after the ingress picked it: a member fails the
            # request at once and the ingress sends it elsewhere (an empty choice would hold it
            # in Serve's retries until a member is back, a whole restart).
            return await super().choose_replicas(candidate_replicas, pending_request)
        return [random.sample(serving, min(2, len(serving)))]
