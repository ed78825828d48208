"""`engram-ray doctor`: what the peer-group path needs on this node, and what it finds.

Each line is `[ ok ]`, `[info]`, `[warn]` or `[FAIL]` with what was found and, where not ok,
what to do. Exit code 0 when the peer path can run here (or there are no GPUs, which is said),
1 when a GPU node lacks something it needs.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass

HELP = ("check this node for the peer-group table path (vLLM version, GPUs, NVLink, VMM, "
        "handles, descriptor passing, shm) and the CPU features vLLM on CPU uses (AVX-512, AMX)")
THP_PATH = "/sys/kernel/mm/transparent_hugepage/enabled"


@dataclass(frozen=True)
class Check:
    name: str
    status: str   # ok, info, warn, fail
    detail: str


def configure(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of lines")
    from engram_ray.tables.backends.base import shm_dir

    # The shm backend's own folder ($ENGRAM_RAY_SHM_DIR, default /dev/shm), not a fixed path.
    parser.add_argument("--shm-dir", default=shm_dir(),
                        help="shared-memory folder to check (default: $ENGRAM_RAY_SHM_DIR or "
                             "/dev/shm, where the shm backend puts its slices)")


def run(args) -> int:
    checks = host_checks(args.shm_dir) + gpu_checks()
    if args.json:
        print(json.dumps([asdict(c) for c in checks], indent=2))
    else:
        for c in checks:
            print(f"[{c.status.upper() if c.status == 'fail' else c.status:^4}] "
                  f"{c.name}: {c.detail}")
    return 1 if any(c.status == "fail" for c in checks) else 0


# --- host -------------------------------------------------------------------------------

def host_checks(shm_dir: str) -> list[Check]:
    return [check_vllm(), check_cpu(), check_shm(shm_dir), check_thp(), check_fd_passing()]


def check_vllm() -> Check:
    """The installed vLLM and whether the DeepSeek-V4.1 patch supports it (the check an engine
    runs when it installs the patch, engram_ray.vllm.compat; vLLM is read, not imported)."""
    from engram_ray.vllm.compat import WAIVED, WHAT_TO_DO, installed_vllm, support_problem

    vllm = installed_vllm()
    if vllm is None:
        return Check("vLLM", "info", "not installed: the engines need the [gpu] or [cpu] extra")
    problem = support_problem(vllm)
    if problem:
        return Check("vLLM", "fail", f"{problem}: {WHAT_TO_DO}")
    waived = "".join(f"; {name} waived: {why}"
                     for name, why in WAIVED.get(vllm.distribution, {}).items())
    return Check("vLLM", "ok", f"{vllm}: supported by the DeepSeek-V4.1 patch (its assumptions "
                 f"hold in {vllm.site / 'vllm'}{waived})")


def check_cpu() -> Check:
    """The CPU features vLLM's CPU backend will use (engram_ray.vllm.cpu_features)."""
    from engram_ray.vllm.cpu_features import CpuFeatures

    cpu = CpuFeatures.probe()
    status = "warn" if cpu.has_amx and not cpu.is_amx_usable else "info"
    return Check("CPU (vLLM CPU backend)", status, cpu.describe())


def check_shm(shm_dir: str) -> Check:
    try:
        st = os.statvfs(shm_dir)
    except OSError as exc:
        return Check("shared memory", "warn", f"{shm_dir}: {exc}; the shm backend needs it")
    free = st.f_bavail * st.f_frsize / 2**30
    return Check("shared memory", "ok" if free >= 1 else "warn",
                 f"{free:.1f} GiB free in {shm_dir}" + ("" if free >= 1 else
                                                       "; the shm backend needs room for tables"))


def check_thp() -> Check:
    try:
        with open(THP_PATH) as f:
            text = f.read()
    except OSError:
        return Check("transparent huge pages", "info", f"{THP_PATH} not readable")
    mode = text[text.index("[") + 1:text.index("]")] if "[" in text else text.strip()
    if mode == "never":
        return Check("transparent huge pages", "warn", "never: host-memory tables (use_thp) get "
                     "no huge pages; `echo madvise > " + THP_PATH + "` as root")
    return Check("transparent huge pages", "ok", mode)


# What a group's peers do at the rendezvous, and a restarted engine does at its holders: take a
# slice's descriptor from a holder in another process.
_TAKE_FROM_HOLDER = ("import sys\n"
                     "from engram_ray.tables.slice_holder import fetch\n"
                     "try:\n    _, fds = fetch(sys.argv[1], 'doctor')\n"
                     "    print('ok' if len(fds) == 1 else f'{len(fds)} descriptors came')\n"
                     "except Exception as exc:\n    print(exc)\n")
FD_PASSING = "descriptor passing (POSIX-FD and shm slices)"


def check_fd_passing() -> Check:
    """A child process takes a descriptor from a slice holder in this one (SCM_RIGHTS over a
    Unix socket in a 0700 folder), as peers and restarted engines take slices: no ptrace."""
    from engram_ray.tables.slice_holder import SliceHolder, SliceHolderError, holder_path

    with tempfile.TemporaryDirectory(prefix="engram-ray-doctor-") as folder:  # 0700
        try:
            result = _take_from_holder(SliceHolder(folder, "doctor", 0), holder_path(folder, 0))
        except (OSError, SliceHolderError) as exc:
            result = str(exc)
    if result != "ok":
        return Check(FD_PASSING, "fail", f"a child process could not take a descriptor from a "
                     f"slice holder in {tempfile.gettempdir()}: {result}; peers and restarted "
                     "engines take slices this way: Unix sockets (AF_UNIX, SCM_RIGHTS) must "
                     "work in the peer_group_store folder")
    return Check(FD_PASSING, "ok", "a child process took a descriptor from a slice holder "
                 "(SCM_RIGHTS over a Unix socket; no ptrace)")


def _take_from_holder(holder, path: str) -> str:
    """'ok' once a child process took the descriptor `holder` holds, else what went wrong."""
    read_fd, write_fd = os.pipe()
    try:
        holder.hold([{"key": 0, "shape": [1, 1], "nbytes": 1, "digest": "",
                      "kind": "doctor"}], [read_fd])
        child = subprocess.run([sys.executable, "-c", _TAKE_FROM_HOLDER, path],
                               capture_output=True, text=True, timeout=60)
        return (child.stdout.strip() or child.stderr.strip()[-300:] or
                f"exit code {child.returncode}")
    except subprocess.TimeoutExpired as exc:
        return str(exc)
    finally:
        holder.close()  # closes read_fd, which the holder held
        os.close(write_fd)


# --- GPUs -------------------------------------------------------------------------------

def gpu_checks() -> list[Check]:
    try:
        import torch
        num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        num_gpus = 0
    if num_gpus == 0:
        return [Check("GPUs", "info", "no CUDA GPUs on this node: the peer path (backend cuda) "
                      "needs GPUs; the shm backend works here for development")]
    names = {torch.cuda.get_device_name(i) for i in range(num_gpus)}
    checks = [Check("GPUs", "ok", f"{num_gpus} x {', '.join(sorted(names))}"), check_peers()]
    try:
        from engram_ray.tables.backends import cuda_driver as drv
        drv.use_device(0)
    except Exception as exc:  # noqa: BLE001 - every failure is a finding here
        return checks + [Check("cuda-bindings", "fail", f"{exc}")]
    checks += [check_vmm(drv, num_gpus), check_fabric(drv), check_posix_fd(drv)]
    return checks + check_nvml_fabric(num_gpus)


def check_peers() -> Check:
    import torch
    num_gpus = torch.cuda.device_count()
    pairs = [(i, j) for i in range(num_gpus) for j in range(num_gpus) if i != j]
    missing = [p for p in pairs if not torch.cuda.can_device_access_peer(*p)]
    if not pairs:
        return Check("NVLink peers", "info", "one GPU: a peer group of 1 (whole local tables)")
    if missing:
        return Check("NVLink peers", "fail", f"no peer access for GPU pairs {missing}: peer "
                     "groups must stay inside one NVLink domain (check `nvidia-smi topo -m`)")
    return Check("NVLink peers", "ok", f"peer access between all {num_gpus} GPUs "
                 f"({_nvlink_summary()})")


def _nvlink_summary() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                             timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "nvidia-smi topo unavailable"
    links = sorted({w for line in out.splitlines() for w in line.split() if w.startswith("NV")
                    and w[2:].isdigit()})
    return "links " + ",".join(links) if links else "no NV# links in nvidia-smi topo -m"


def check_vmm(drv, num_gpus: int) -> Check:
    bad = [i for i in range(num_gpus) if not drv.device_attribute(
        i, "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED")]
    if bad:
        return Check("CUDA VMM", "fail", f"GPUs {bad} lack virtual memory management: "
                     "update the driver (>= 11.2 API)")
    return Check("CUDA VMM", "ok", "cuMemCreate/cuMemMap supported")


def check_fabric(drv) -> Check:
    attr = drv.device_attribute(0, "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED")
    channels = drv.imex_channels()
    trial = drv.trial_allocation(0, "fabric") if attr else "not attempted"
    detail = (f"attribute {attr}; trial cuMemCreate(FABRIC): {trial}; IMEX channels in "
              f"{drv.IMEX_CHANNEL_DIR}: {channels or 'none'}")
    if trial == "ok":
        return Check("FABRIC handles", "ok", detail)
    return Check("FABRIC handles", "info", detail + ": groups across hosts need the IMEX "
                 "daemon and a channel (nvidia-imex, /dev/nvidia-caps-imex-channels/channel0); "
                 "one host uses POSIX FDs")


def check_posix_fd(drv) -> Check:
    trial = drv.trial_allocation(0, "posix_fd")
    if trial == "ok":
        return Check("POSIX-FD handles", "ok", "cuMemCreate + cuMemExportToShareableHandle")
    return Check("POSIX-FD handles", "fail", f"trial export: {trial}: one-host groups need it")


def check_nvml_fabric(num_gpus: int) -> list[Check]:
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001
        return [Check("NVML fabric state", "info", f"NVML unavailable ({exc}); "
                      "pip install nvidia-ml-py")]
    states = []
    for i in range(num_gpus):
        handle = pynvml.nvmlDeviceGetHandleByIndex(i)
        try:
            info = pynvml.c_nvmlGpuFabricInfo_t()
            pynvml.nvmlDeviceGetGpuFabricInfo(handle, ctypes.byref(info))
            states.append(f"GPU {i}: state {info.state} status {info.status}")
        except Exception as exc:  # noqa: BLE001 - NOT_SUPPORTED on non-NVSwitch-fabric systems
            states.append(f"GPU {i}: {exc}")
    pynvml.nvmlShutdown()
    return [Check("NVML fabric state", "info", "; ".join(states) + " (state 3 = completed; "
                  "needed for multi-node NVLink only)")]
