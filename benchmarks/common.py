"""What every benchmark writes beside its numbers and where it writes them (STYLE rule 14).

`environment()`: the date, the commit, whether the tracked files matched it, and the device
(the GPU's name, or the CPU, cores and memory). `write_results(folder, report, markdown)`:
`benchmarks/results/<benchmark>/latest.md` (the newest run) and one line appended to
`history.jsonl` (device, date, commit, then the run's figures). A lent GPU machine's copy of
the tree has no `.git`: its scripts pass the commit in `$ENGRAM_COMMIT` and point `--results`
at a copy of the folder under `$OUT`, whose two files are then copied back and committed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
REPO = RESULTS.parent.parent


def commit() -> str:
    """$ENGRAM_COMMIT, else the checkout's HEAD (short), else "unknown"."""
    found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                           text=True, cwd=REPO).stdout.strip()
    return os.environ.get("ENGRAM_COMMIT") or found or "unknown"


def worktree_clean() -> bool | None:
    """Whether tracked files match the commit (None: no git checkout, e.g. a lent machine)."""
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                            capture_output=True, text=True, cwd=REPO)
    return None if status.returncode else not status.stdout.strip()


def machine() -> str:
    """The CPU, its cores and the memory: "AMD EPYC ..., 2 cores, 24 GiB"."""
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    mem = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    return f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB"


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def environment(gpu: bool = False) -> dict:
    """date, commit, worktree_clean, device, host, cpus; with `gpu`: GPU 0's name as the
    device, num_gpus, num_sms, torch and Triton versions."""
    env = {"date": now(), "commit": commit(), "worktree_clean": worktree_clean(),
           "device": machine(), "host": platform.node(), "cpus": os.cpu_count()}
    if gpu:
        import torch
        import triton
        props = torch.cuda.get_device_properties(0)
        env.update(device=props.name, num_gpus=torch.cuda.device_count(),
                   num_sms=props.multi_processor_count, torch=torch.__version__,
                   triton=triton.__version__)
    return env


def add_results_argument(parser: argparse.ArgumentParser, benchmark: str) -> None:
    """`--results DIR`: where latest.md and history.jsonl go (default results/<benchmark>)."""
    parser.add_argument("--results", type=Path, default=RESULTS / benchmark,
                        help=f"folder of latest.md and history.jsonl (default "
                             f"benchmarks/results/{benchmark})")


def write_results(folder: Path, report: dict, markdown: str, env: dict | None = None) -> Path:
    """`folder/latest.md` = `markdown`; one `history.jsonl` line: device, date and commit
    (from `env`, else from `report` itself) followed by `report`."""
    env = report if env is None else env
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    line = {key: env.get(key) for key in ("device", "date", "commit")}
    with open(folder / "history.jsonl", "a") as history:
        history.write(json.dumps({**line, **report}) + "\n")
    (folder / "latest.md").write_text(markdown)
    print(f"results: {folder / 'latest.md'} and one line of {folder / 'history.jsonl'}")
    return folder / "latest.md"
