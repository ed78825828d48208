"""NVLink domain decisions on recorded NVML answers (no NVML, no GPU needed)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from engram_ray.planning.topology import (FABRIC_CLIQUE_ID_UNSET, KIND_HOST, KIND_MNNVL, KIND_NONE,
                                          NVML_GPU_FABRIC_STATE_COMPLETED, FabricInfo, GpuReport,
                                          NodeReport, decide_domain, format_labels, label_value,
                                          node_labels)

RACK_UUID = "5f3c0a1e9b7d4c2a8e6f1b3d5a7c9e0f"
NVML_ERROR_NOT_READY = 12  # an nvmlReturn_t other than NVML_SUCCESS
NVML_GPU_FABRIC_STATE_NOT_SUPPORTED, NVML_GPU_FABRIC_STATE_IN_PROGRESS = 0, 2

# Recorded answers, as nvmlDeviceGetGpuFabricInfoV / nvmlDeviceGetP2PStatus(NVLINK) gave them.
GB200_TRAY = {  # one compute tray of a GB200 NVL72 rack: 4 GPUs, fabric registered
    "hostname": "gb200-r07-t03",
    "gpus": [{"uuid": f"GPU-7a1c{i}", "fabric": {"clusterUuid": RACK_UUID, "cliqueId": 32766,
                                                 "state": 3, "status": 0}} for i in range(4)],
    "nvlink": "all",
}
H200_NV18 = {  # 2 x H200, NV18; recorded 2026-11-30, driver 580.159.04, nvidia-ml-py 13.615.71:
    # fabric state COMPLETED with status SUCCESS but a zero cluster UUID and clique 0.
    "hostname": "vm",
    "gpus": [{"uuid": uuid, "fabric": {"clusterUuid": "00" * 16, "cliqueId": 0, "state": 3,
                                       "status": 0}}
             for uuid in ("GPU-7500a3ca-c8ad-5696-b342-13bd36c47281",
                          "GPU-80c873ec-2e12-baaf-80f9-dada8d5ee380")],
    "nvlink": [(0, 1)],
}
HGX_8GPU = dict(H200_NV18, hostname="h200-node-12", nvlink="all",  # older driver: no fabric
                gpus=[{"uuid": f"GPU-h200-{i}", "fabric": {"clusterUuid": "00" * 16,
                                                           "cliqueId": 0, "state": 0,
                                                           "status": 0}} for i in range(8)])
L40S_PCIE = {  # 4 GPUs on PCIe only: no NVLink pair, old driver without fabric info
    "hostname": "l40s-box", "gpus": [{"uuid": f"GPU-l40s-{i}", "fabric": None} for i in range(4)],
    "nvlink": [],
}


def _report(recorded: dict, **fabric_changes) -> NodeReport:
    gpus = []
    for index, gpu in enumerate(recorded["gpus"]):
        fabric = gpu["fabric"]
        if fabric is not None:
            fabric = dict(fabric, **fabric_changes)
            fabric = FabricInfo(bytes.fromhex(fabric["clusterUuid"]), fabric["cliqueId"],
                                fabric["state"], fabric["status"])
        gpus.append(GpuReport(index, gpu["uuid"], fabric))
    n = len(gpus)
    pairs = ({(i, j) for i in range(n) for j in range(i + 1, n)} if recorded["nvlink"] == "all"
             else set(map(tuple, recorded["nvlink"])))
    return NodeReport(recorded["hostname"], tuple(gpus), frozenset(pairs))


def test_registered_fabric_names_the_rack_domain():
    decision = decide_domain(_report(GB200_TRAY))
    assert decision.kind == KIND_MNNVL
    assert decision.domain_id == f"mnnvl-{RACK_UUID}-32766"
    assert decision.can_form_peer_group and decision.num_gpus == 4


def test_trays_of_one_rack_share_the_domain_and_other_cliques_do_not():
    other_tray = dict(GB200_TRAY, hostname="gb200-r07-t04")
    assert decide_domain(_report(other_tray)).domain_id == decide_domain(
        _report(GB200_TRAY)).domain_id
    assert decide_domain(_report(GB200_TRAY, cliqueId=32767)).domain_id != decide_domain(
        _report(GB200_TRAY)).domain_id


@pytest.mark.parametrize("changes, what", [
    (dict(state=NVML_GPU_FABRIC_STATE_IN_PROGRESS), "registration still in progress"),
    (dict(status=NVML_ERROR_NOT_READY), "completed with an error status"),
    (dict(clusterUuid="00" * 16), "zero cluster UUID"),
    (dict(cliqueId=FABRIC_CLIQUE_ID_UNSET), "unset clique id"),
])
def test_unusable_fabric_falls_back_to_the_host(changes, what):
    decision = decide_domain(_report(GB200_TRAY, **changes))
    assert decision.kind == KIND_HOST, what
    assert decision.domain_id == "host-gb200-r07-t03"


def test_fabric_on_some_gpus_only_is_not_a_rack_domain():
    recorded = dict(GB200_TRAY, gpus=GB200_TRAY["gpus"][:3] + [
        {"uuid": "GPU-x", "fabric": dict(GB200_TRAY["gpus"][0]["fabric"], state=1)}])
    decision = decide_domain(_report(recorded))
    assert decision.kind == KIND_HOST and "only some GPUs" in decision.reason


def test_recorded_h200_pair_is_one_host_domain():
    decision = decide_domain(_report(H200_NV18))
    assert (decision.kind, decision.domain_id, decision.num_gpus) == (KIND_HOST, "host-vm", 2)
    assert "zero cluster UUID" in decision.reason


def test_single_host_nvswitch_is_one_domain():
    decision = decide_domain(_report(HGX_8GPU))
    assert (decision.kind, decision.domain_id, decision.num_gpus) == (KIND_HOST,
                                                                      "host-h200-node-12", 8)
    assert "not completed" in decision.reason
    assert FabricInfo(bytes(16), 0, NVML_GPU_FABRIC_STATE_NOT_SUPPORTED).domain_key is None


def test_gpus_without_nvlink_are_their_own_domains():
    decision = decide_domain(_report(L40S_PCIE))
    assert decision.kind == KIND_NONE and decision.domain_id == "none"
    assert not decision.can_form_peer_group
    assert "every GPU is its own domain" in decision.reason
    assert "no peer group" in decision.reason


def test_partial_nvlink_is_not_one_domain():
    recorded = dict(L40S_PCIE, nvlink=[(0, 1), (2, 3)])  # two NVLink bridges, pairs only
    decision = decide_domain(_report(recorded))
    assert decision.kind == KIND_NONE and "not all NVLink peers" in decision.reason


def test_one_gpu_and_no_gpu_have_no_domain():
    one = decide_domain(_report(dict(HGX_8GPU, gpus=HGX_8GPU["gpus"][:1])))
    assert one.kind == KIND_NONE and one.reason.startswith("one GPU")
    none = decide_domain(NodeReport("cpu-only"))
    assert none.kind == KIND_NONE and none.num_gpus == 0


def test_completed_fabric_constant_matches_nvml():
    assert NVML_GPU_FABRIC_STATE_COMPLETED == 3
    assert FabricInfo(bytes.fromhex(RACK_UUID), 5, 3).is_known


def test_node_labels_and_ray_start_value():
    labels = node_labels(_report(HGX_8GPU))
    assert labels == {"engram.io/nvlink-domain": "host-h200-node-12"}
    assert node_labels(_report(HGX_8GPU), key="example.com/domain") == {
        "example.com/domain": "host-h200-node-12"}
    assert format_labels({"a/b": "x", "c": "y"}) == "a/b=x,c=y"


@pytest.mark.parametrize("text", [
    "host-" + "very-long-hostname." * 8, "host-node_7:gpu@rack", "-.-", f"mnnvl-{RACK_UUID}-9"])
def test_label_values_are_valid_for_ray(text):
    value = label_value(text)
    assert re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?", value), value
    label_utils = pytest.importorskip("ray._private.label_utils")
    label_utils.validate_label_value(value)


def test_long_label_values_stay_distinct():
    a, b = "host-" + "x" * 80 + "a", "host-" + "x" * 80 + "b"
    assert label_value(a) != label_value(b)


def test_cli_prints_the_labels_value():
    result = subprocess.run([sys.executable, "-m", "engram_ray.cli", "node-labels"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(r"engram\.io/nvlink-domain=[A-Za-z0-9._-]+\n", result.stdout)
    assert "[node-labels]" in result.stderr
