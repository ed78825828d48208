"""`engram-ray status`: the peer groups of a running deployment, from its coordinator actor
(`engram-coordinator-<deployment.name>`, namespace `engram`): per group its NVLink domain,
current generation (and how many came before), members, how many are ready, and whether the
ingress sends it requests (else why not).

    engram-ray status                   # RAY_ADDRESS, else the local cluster; its deployment
    engram-ray status --address 10.0.0.1:6379 --name dsv41-flash   # one of several
    engram-ray status --json
"""

from __future__ import annotations

import json
import logging

from engram_ray.errors import EngramRayError

HELP = "show the peer groups (generations, members, ready, serving) of a running deployment"
TIMEOUT_S = 30


def configure(parser) -> None:
    parser.add_argument("--address", default="auto",
                        help="Ray cluster to connect to (GCS address host:port; 'auto' uses "
                             "RAY_ADDRESS or the cluster started on this node)")
    parser.add_argument("--name", default=None,
                        help="the deployment's deployment.name (default: the cluster's one "
                             "deployment; with several, they are listed)")
    parser.add_argument("--json", action="store_true",
                        help="print status and routing as JSON")


def deployment_names() -> list[str]:
    """The deployment names of every coordinator on the cluster (Ray connected)."""
    import ray

    from engram_ray.actors.coordinator import coordinator_name

    prefix = coordinator_name("")
    return sorted(a["name"][len(prefix):] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a.get("namespace") == "engram" and a["name"].startswith(prefix))


def the_deployment() -> str:
    """The cluster's one deployment; EngramRayError naming them when there are none or
    several."""
    names = deployment_names()
    if len(names) == 1:
        return names[0]
    if not names:
        raise EngramRayError("no engram-ray deployment on this cluster (no coordinator in "
                             "namespace engram): is it running, and is this its cluster?")
    raise EngramRayError(f"{len(names)} engram-ray deployments on this cluster: "
                         f"{', '.join(names)}; choose one with --name")


def collect(name: str) -> dict:
    """{group id: status + routing} from the coordinator of deployment `name` (Ray connected)."""
    import ray

    from engram_ray.actors.coordinator import coordinator_name
    from engram_ray.actors.coordinator_lookup import find_coordinator

    try:
        coordinator = find_coordinator(name)
    except ValueError:
        raise EngramRayError(f"no coordinator {coordinator_name(name)} (namespace engram) on "
                             "this cluster: is the deployment running, and is --name its "
                             "deployment.name?") from None
    status, (_, routing), roll = ray.get([coordinator.status.remote(),
                                          coordinator.routing.remote(),
                                          coordinator.roll_status.remote()], timeout=TIMEOUT_S)
    versions = roll.pop("member_versions", {})
    groups = {gid: {**group, **routing.get(gid, {}), "settings_roll": roll}
              for gid, group in status.items()}
    for group in groups.values():
        for member in group.get("members", {}).values():
            member["config_version"] = versions.get(member.get("replica_id"))
    return groups


def format_status(name: str, groups: dict) -> str:
    rows = [("GROUP", "DOMAIN", "GENERATION", "RESTARTS", "MEMBERS", "READY", "SERVING")]
    for gid in sorted(groups):
        g = groups[gid]
        rows.append((gid, str(g.get("domain")), str(g.get("generation") or "-"),
                     str(len(g.get("history", []))), str(len(g.get("members", {}))),
                     str(len(g.get("ready_at", {}))),
                     "yes" if g.get("serving") else f"no: {g.get('reason')}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = [f"deployment {name}: {sum(bool(g.get('serving')) for g in groups.values())} of "
             f"{len(groups)} groups serving"]
    for row in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1])
    for gid in sorted(groups):
        g = groups[gid]
        ready = {str(r) for r in g.get("ready_at", {})}
        restarting = {str(r) for r in g.get("restarting", {})}
        for rank in sorted(g.get("members", {}), key=int):
            member = g["members"][rank]
            state = ("engine restarting" if str(rank) in restarting
                     else "ready" if str(rank) in ready else "not ready")
            version = member.get("config_version")
            lines.append(f"  {gid} rank {rank}: {member.get('replica_id')} ({state}"
                         + (f", settings {version})" if version else ")"))
        if g.get("starting"):  # a rolling change (serving.rollout.mode beside)
            lines.append(f"  {gid} rolling: generation {g['starting']} starting beside")
        if g.get("retired"):
            lines.append(f"  {gid} rolling: generation {g['retired']} replaced, draining")
    roll = next((g["settings_roll"] for g in groups.values() if g.get("settings_roll")), None)
    if roll:
        lines.append(roll_line(roll))
    return "\n".join(lines)


def roll_line(roll: dict) -> str:
    """The engine settings' roll in one line (`Coordinator.roll_status`)."""
    text = (f"settings {roll['version']} (rollout {roll['mode']}): {roll['done']} of "
            f"{roll['members']} members run them")
    if roll.get("restarting"):
        text += f"; restarting now: {', '.join(roll['restarting'])}"
    if roll.get("stopped"):
        text += (f"; ROLL STOPPED at {roll['stopped']['replica_id']}: "
                 f"{roll['stopped']['reason']}")
    return text


def run(args) -> int:
    import ray

    try:
        ray.init(address=args.address, namespace="engram", log_to_driver=False,
                 logging_level=logging.WARNING, configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise EngramRayError(f"cannot connect to Ray at {args.address}: "
                             f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
                             ) from None
    try:
        name = args.name or the_deployment()
        groups = collect(name)
    finally:
        ray.shutdown()
    if args.json:
        print(json.dumps(groups, indent=2, sort_keys=True, default=str))
    else:
        print(format_status(name, groups))
    return 0
