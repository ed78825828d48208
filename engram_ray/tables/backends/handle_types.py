"""Which CUDA handle type a peer group's slices travel as: the decisions, without a GPU.

A member may request a type (`handle_type` "fabric" | "posix_fd"; a cross-node group requests
"fabric", the only one that leaves its host) or leave the choice to the group (None):

- `check_handle_request`: the request as configured (ConfigError naming the field);
- `requested_type`: what a member asks for, given `handle_type` and `cross_node`;
- `offered_types`: what it offers, from what its GPU can use (`cuda_driver.usable_handle_types`):
  only the request, or every usable type; a request the GPU cannot use fails at once;
- `choose_handle_type`: the group's type from the rendezvous records (every member decides
  alike): the request every member made, else the first in HANDLE_PREFERENCE every member
  offers; members that requested different types are refused, by rank.
"""

from __future__ import annotations

from engram_ray.errors import ConfigError
from engram_ray.tables.backends.base import PeerMemoryError, same_host

HANDLE_TYPES = ("fabric", "posix_fd")
HANDLE_PREFERENCE = HANDLE_TYPES  # without a request, the first every member offers wins
_HOW_TO_ENABLE = {
    "fabric": "FABRIC handles need an IMEX channel (/dev/nvidia-caps-imex-channels) on every "
              "node: enable one",
    "posix_fd": "POSIX-FD handles need cuMemCreate export support (see the doctor's POSIX-FD "
                "line)",
}


def check_handle_request(handle_type: str | None, cross_node: bool, field: str) -> None:
    """Raise ConfigError (`<field>.handle_type` / `<field>.cross_node`) unless `handle_type`
    is None or one of HANDLE_TYPES, and a cross-node group asks for 'fabric'."""
    if handle_type is not None and handle_type not in HANDLE_TYPES:
        raise ConfigError(f"{field}.handle_type", f"is {handle_type!r}",
                          f"one of {', '.join(HANDLE_TYPES)}, or unset to let the group choose")
    if not isinstance(cross_node, bool):
        raise ConfigError(f"{field}.cross_node", f"is {cross_node!r}", "true or false")
    if cross_node and handle_type != "fabric":
        raise ConfigError(
            f"{field}.handle_type", f"is {handle_type!r} for a cross-node group",
            "'fabric': peers on other hosts can only map CUDA FABRIC handles (needs an IMEX "
            "channel); keep the group inside one host or enable FABRIC handles")


def requested_type(handle_type: str | None, cross_node: bool = False) -> str | None:
    """The type this member asks the group for: `handle_type`, 'fabric' for a cross-node
    group, None to let the group choose."""
    if handle_type is not None and handle_type not in HANDLE_TYPES:
        raise PeerMemoryError(f"handle_type {handle_type!r} is not a CUDA handle type "
                              f"(expected one of {', '.join(HANDLE_TYPES)}, or None)")
    if cross_node and handle_type == "posix_fd":
        raise PeerMemoryError(
            "handle_type 'posix_fd' was requested for a cross-node group: POSIX file "
            "descriptors cannot leave their host; request 'fabric', or keep the group on one "
            "host and drop cross_node")
    return "fabric" if cross_node else handle_type


def offered_types(usable: tuple[str, ...], requested: str | None = None,
                  device_idx: int = 0) -> tuple[str, ...]:
    """What a member offers: every `usable` type (best first) without a request, else only
    `requested`. PeerMemoryError when GPU `device_idx` cannot use it, naming what it can."""
    if requested is None:
        if not usable:
            raise PeerMemoryError(f"GPU {device_idx} can export neither FABRIC nor POSIX-FD "
                                  "handles: run `engram-ray doctor`")
        return tuple(usable)
    if requested not in usable:
        raise PeerMemoryError(
            f"handle_type {requested!r} was requested but GPU {device_idx} cannot use it (it "
            f"offers {list(usable) or 'no handle type'}): {_HOW_TO_ENABLE[requested]}; run "
            "`engram-ray doctor` on this node, or drop handle_type to let the group choose")
    return (requested,)


def choose_handle_type(records: list[dict]) -> str:
    """The group's handle type from every member's rendezvous record (`rank`, `host`,
    `boot_id`, `handle_types` offered, `handle_request`): the common request, else the first
    in HANDLE_PREFERENCE every member offers. POSIX FDs only within one host."""
    requests = {r["rank"]: r.get("handle_request") for r in records}
    if len(set(requests.values())) > 1:
        raise PeerMemoryError(
            f"members requested different handle types (by rank: {requests}; None: let the "
            "group choose): give every member of the group the same handle_type")
    requested = requests[records[0]["rank"]]
    one_host = all(same_host(records[0], r) for r in records)
    hosts = sorted({r["host"] for r in records})
    if requested == "posix_fd" and not one_host:
        raise PeerMemoryError(
            f"handle_type 'posix_fd' was requested for a group on several hosts ({hosts}): "
            "POSIX file descriptors cannot leave their host; request 'fabric' (cross_node) or "
            "keep the group on one host")
    for kind in (requested,) if requested else HANDLE_PREFERENCE:
        if all(kind in r["handle_types"] for r in records) and (kind != "posix_fd" or one_host):
            return kind
    offers = {r["rank"]: r["handle_types"] for r in records}
    missing = (f"the requested handle type {requested!r} is not offered by every member"
               if requested else "no handle type every member can use")
    raise PeerMemoryError(
        f"{missing} (offered by rank: {offers}; hosts: {hosts}): across hosts FABRIC handles "
        "need an IMEX channel (/dev/nvidia-caps-imex-channels); on one host POSIX FDs need "
        "cuMemCreate export support. Run `engram-ray doctor` on each node")
