"""Which GPUs share an NVLink domain, and the Ray node label that says so.

A node's domain, decided from what NVML reports (`decide_domain`, a pure function):

1. Multi-node NVLink (GB200/GB300 NVL72): every GPU of the node reports GPU fabric info
   (`nvmlDeviceGetGpuFabricInfoV`) with `state == NVML_GPU_FABRIC_STATE_COMPLETED`,
   `status == NVML_SUCCESS`, a non-zero cluster UUID and a clique id other than the unset
   sentinel, and all of them name the same (cluster UUID, clique id):
   domain `mnnvl-<uuid hex>-<clique id>`, shared with the other hosts of the rack.
2. One host with two or more GPUs that are all NVLink peers of each other
   (`nvmlDeviceGetP2PStatus(..., NVML_P2P_CAPS_INDEX_NVLINK) == NVML_P2P_STATUS_OK`):
   domain `host-<hostname>`.
3. Otherwise (one GPU, GPUs without NVLink between them, no GPU): no domain. The node is
   labelled `none`, every GPU is its own domain, and no peer group larger than 1 can form.

`node_labels()` turns the decision into the labels of `ray start --labels`; the
`engram-ray node-labels` command prints them. NVML (`pynvml` from nvidia-ml-py) is imported only
by `probe_node`, so the decision logic runs and is tested without it.
"""

from __future__ import annotations

import hashlib
import re
import socket
from dataclasses import dataclass, field

from engram_ray.config import DEFAULT_DOMAIN_LABEL_KEY

NVML_SUCCESS = 0
NVML_GPU_FABRIC_STATE_COMPLETED = 3
# NOTES: a clique id of all ones is what fabric tooling (NCCL's MNNVL override, -1 as uint32)
# uses for "not set"; a zero cluster UUID means the GPU is not in a multi-node NVLink fabric.
FABRIC_CLIQUE_ID_UNSET = 0xFFFFFFFF
FABRIC_UUID_LEN = 16

NO_DOMAIN = "none"
KIND_MNNVL, KIND_HOST, KIND_NONE = "mnnvl", "host", "none"
MAX_LABEL_VALUE_CHARS = 63  # Kubernetes label syntax, which Ray enforces
_LABEL_INVALID = re.compile(r"[^A-Za-z0-9_.-]")


@dataclass(frozen=True)
class FabricInfo:
    """One GPU's answer to nvmlDeviceGetGpuFabricInfoV (the fields the decision needs)."""

    cluster_uuid: bytes
    clique_id: int
    state: int
    status: int = NVML_SUCCESS

    @property
    def is_known(self) -> bool:
        """Registration finished, succeeded, and names a real cluster and clique."""
        return (self.state == NVML_GPU_FABRIC_STATE_COMPLETED and self.status == NVML_SUCCESS
                and any(self.cluster_uuid) and self.clique_id != FABRIC_CLIQUE_ID_UNSET)

    @property
    def why_unknown(self) -> str:
        """Why this answer names no multi-node domain ('' when it does)."""
        if self.state != NVML_GPU_FABRIC_STATE_COMPLETED:
            return f"fabric state {self.state}, not completed ({NVML_GPU_FABRIC_STATE_COMPLETED})"
        if self.status != NVML_SUCCESS:
            return f"fabric registration failed (status {self.status})"
        if not any(self.cluster_uuid):
            return "fabric completed with a zero cluster UUID (no multi-node NVLink)"
        if self.clique_id == FABRIC_CLIQUE_ID_UNSET:
            return "fabric clique id unset"
        return ""

    @property
    def domain_key(self) -> tuple[bytes, int] | None:
        return (bytes(self.cluster_uuid), self.clique_id) if self.is_known else None


@dataclass(frozen=True)
class GpuReport:
    index: int
    uuid: str
    fabric: FabricInfo | None = None  # None: NVML has no fabric info for this GPU


@dataclass(frozen=True)
class NodeReport:
    """What NVML says about one node: its GPUs and which pairs are NVLink peers."""

    hostname: str
    gpus: tuple[GpuReport, ...] = ()
    nvlink_pairs: frozenset[tuple[int, int]] = field(default_factory=frozenset)

    def are_all_nvlink_peers(self) -> bool:
        indices = [gpu.index for gpu in self.gpus]
        return all((a, b) in self.nvlink_pairs or (b, a) in self.nvlink_pairs
                   for i, a in enumerate(indices) for b in indices[i + 1:])


@dataclass(frozen=True)
class DomainDecision:
    """The NVLink domain of a node: `domain_id` is the label value (`none`: no domain)."""

    domain_id: str
    kind: str
    reason: str
    num_gpus: int

    @property
    def can_form_peer_group(self) -> bool:
        return self.kind != KIND_NONE


def label_value(text: str) -> str:
    """`text` as a valid Ray label value (<= 63 chars of [A-Za-z0-9_.-], alphanumeric ends)."""
    value = _LABEL_INVALID.sub("-", text).strip("-_.")
    if len(value) > MAX_LABEL_VALUE_CHARS:
        digest = hashlib.sha256(text.encode()).hexdigest()[:8]
        value = value[:MAX_LABEL_VALUE_CHARS - 9].rstrip("-_.") + "-" + digest
    return value or "unnamed"


def mnnvl_domain_id(fabric: FabricInfo) -> str:
    return f"mnnvl-{bytes(fabric.cluster_uuid).hex()}-{fabric.clique_id}"


def decide_domain(report: NodeReport) -> DomainDecision:
    """The node's NVLink domain from its NVML answers (see the module docstring)."""
    num_gpus = len(report.gpus)
    if num_gpus == 0:
        return DomainDecision(NO_DOMAIN, KIND_NONE, "no GPU on this node", 0)
    keys = {gpu.fabric.domain_key if gpu.fabric else None for gpu in report.gpus}
    if None not in keys and len(keys) == 1:
        fabric = report.gpus[0].fabric
        return DomainDecision(label_value(mnnvl_domain_id(fabric)), KIND_MNNVL,
                              f"GPU fabric registered: cluster {fabric.cluster_uuid.hex()} "
                              f"clique {fabric.clique_id}", num_gpus)
    fabric_note = _fabric_note(report, keys)
    if num_gpus >= 2 and report.are_all_nvlink_peers():
        return DomainDecision(label_value(f"host-{report.hostname}"), KIND_HOST,
                              f"all {num_gpus} GPUs are NVLink peers on this host "
                              f"({fabric_note})", num_gpus)
    why = ("one GPU" if num_gpus == 1 else
           f"the {num_gpus} GPUs are not all NVLink peers of each other")
    return DomainDecision(NO_DOMAIN, KIND_NONE,
                          f"{why} and {fabric_note}: every GPU is its own domain, no peer "
                          "group larger than 1 can form on this node", num_gpus)


def _fabric_note(report: NodeReport, keys: set) -> str:
    if keys == {None}:
        whys = {gpu.fabric.why_unknown if gpu.fabric else "no fabric info from NVML"
                for gpu in report.gpus}
        return "no multi-node NVLink fabric: " + "; ".join(sorted(whys))
    if None in keys:
        return "only some GPUs report a registered fabric"
    return f"the GPUs report {len(keys)} different fabric cliques"


def node_labels(report: NodeReport | None = None,
                key: str = DEFAULT_DOMAIN_LABEL_KEY) -> dict[str, str]:
    """Ray node labels for this node (probes NVML when `report` is None)."""
    decision = decide_domain(report if report is not None else probe_node())
    return {key: decision.domain_id}


def format_labels(labels: dict[str, str]) -> str:
    """`k=v,k2=v2`: the value of `ray start --labels`."""
    return ",".join(f"{k}={v}" for k, v in labels.items())


# --- NVML (only here; imported lazily) -------------------------------------------------------

def probe_node() -> NodeReport:
    """Ask NVML about this node's GPUs. Without NVML (no driver, no nvidia-ml-py): no GPUs."""
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:  # ImportError, or NVMLError_LibraryNotFound / DriverNotLoaded
        return NodeReport(hostname=socket.gethostname())
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i)
                   for i in range(pynvml.nvmlDeviceGetCount())]
        gpus = tuple(GpuReport(i, _text(pynvml.nvmlDeviceGetUUID(h)), _probe_fabric(pynvml, h))
                     for i, h in enumerate(handles))
        pairs = frozenset((i, j) for i in range(len(handles)) for j in range(i + 1, len(handles))
                          if _is_nvlink_pair(pynvml, handles[i], handles[j]))
        return NodeReport(socket.gethostname(), gpus, pairs)
    finally:
        pynvml.nvmlShutdown()


def _probe_fabric(pynvml, handle) -> FabricInfo | None:
    import ctypes

    try:
        info = pynvml.c_nvmlGpuFabricInfoV_t()
        pynvml.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(info))
    except Exception:  # NVMLError_NotSupported, or bindings / drivers without fabric info
        return None
    # NOTES: read the UUID as raw bytes: some bindings decode byte arrays as text and stop at NUL.
    uuid_field = type(info).clusterUuid
    cluster_uuid = ctypes.string_at(ctypes.addressof(info) + uuid_field.offset,
                                    FABRIC_UUID_LEN)
    return FabricInfo(cluster_uuid, int(info.cliqueId), int(info.state), int(info.status))


def _is_nvlink_pair(pynvml, handle_a, handle_b) -> bool:
    try:
        status = pynvml.nvmlDeviceGetP2PStatus(handle_a, handle_b,
                                               pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
    except Exception:
        return False
    return status == pynvml.NVML_P2P_STATUS_OK


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
