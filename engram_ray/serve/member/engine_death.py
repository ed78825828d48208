"""Why a replica's vLLM engine died, in one line, and where that line is kept.

A vLLM engine is two processes below its Serve replica: EngineCore (a child) and its worker (a
grandchild, which runs the model). vLLM logs a worker's death as an exit code once the worker is
ready, and not at all before; the plugin (`engram_ray.vllm.plugin`) turns on `faulthandler`, so
a process killed by a fatal signal also writes "Fatal Python error: <signal>" and its Python
stack. Both land in the replica's own log (the engine processes inherit its stdout and stderr).
`explain()` reads them into a cause such as "worker exited with SIGILL (illegal instruction)
during a forward pass"; the replica logs `EngineDeath.line()`, raises it from its health check
and start, and records it in its deployment's store folder, where `engram-ray local` finds it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from engram_ray.errors import EngramRayError
from engram_ray.private_dirs import private_dir

# vllm/v1/executor/multiproc_executor.py, vllm/v1/engine/utils.py (vLLM 0.32-0.33)
_WORKER_DIED = re.compile(r"Worker proc (\S+) died unexpectedly \(exit code: (-?\d+)\)")
_WORKER_INIT_FAILED = "WorkerProc initialization failed"
_CORE_FAILED = re.compile(r"Failed core proc\(s\): \{([^}]*)\}")
_CORE_EXITED = "engine core exited unexpectedly"
# faulthandler: "Fatal Python error: Illegal instruction", then 'File "...", line N in name'
_FATAL = re.compile(r"Fatal Python error: ([^\n]+)")
_FRAME = re.compile(r'File "([^"]+)", line (\d+) in (\w+)')
_FORWARD_FRAMES = {"execute_model", "_dummy_run", "profile_run", "_dummy_sampler_run",
                   "forward", "sample_tokens"}
_LOAD_FRAMES = {"load_model", "load_weights"}
MAX_LOG_BYTES = 1 << 20  # the tail of the log that is searched
_SIGNAL_WORDS = {"SIGILL": "illegal instruction", "SIGSEGV": "segmentation fault",
                 "SIGBUS": "bus error", "SIGFPE": "floating-point exception",
                 "SIGABRT": "aborted", "SIGKILL": "killed: out of memory, or by hand",
                 "SIGTERM": "terminated"}


def describe_exit(code: int) -> str:
    """'exited with SIGILL (illegal instruction)' for -4; 'exited with code 1' for 1."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            return f"was killed by signal {-code}"
        words = _SIGNAL_WORDS.get(name)
        return f"exited with {name}" + (f" ({words})" if words else "")
    return f"exited with code {code}"


def _fatal_signal(text: str) -> tuple[str | None, str | None]:
    """(what faulthandler said, where: 'a forward pass' | 'model loading' | None)."""
    matches = list(_FATAL.finditer(text))
    if not matches:
        return None, None
    last = matches[-1]
    # The thread that took the signal: "Current thread 0x... (most recent call first):"
    current = text.find("Current thread", last.end())
    stack = text[current if current >= 0 else last.end():].split("\n\n", 1)[0]
    frames = [m.group(3) for m in _FRAME.finditer(stack)][:60]
    if _FORWARD_FRAMES & set(frames):
        where = "a forward pass"
    elif _LOAD_FRAMES & set(frames):
        where = "model loading"
    else:
        where = None
    return last.group(1).strip().lower(), where


def _fatal_exit(fatal: str | None) -> str:
    """'exited with SIGILL (illegal instruction)' from faulthandler's 'Illegal instruction'."""
    if fatal is None:
        return "exited"
    name = next((n for n, words in _SIGNAL_WORDS.items() if words == fatal), None)
    return f"exited with {name} ({fatal})" if name else f"was killed ({fatal})"


def explain(log_text: str, exit_codes: dict[str, int | None] | None = None) -> str | None:
    """The cause of an engine's death from its replica's log (and EngineCore exit codes the
    replica read itself); None when the log shows no process death."""
    fatal, where = _fatal_signal(log_text)
    during = f" during {where}" if where else ""
    worker = list(_WORKER_DIED.finditer(log_text))
    if worker:
        return f"worker {describe_exit(int(worker[-1].group(2)))}{during}"
    if _WORKER_INIT_FAILED in log_text:
        return f"worker {_fatal_exit(fatal)}{during or ' while it started'}"
    codes = {name: code for name, code in (exit_codes or {}).items() if code}
    core = list(_CORE_FAILED.finditer(log_text))
    if not codes and core:
        codes = {k.strip(" '\""): int(v) for k, v in
                 (pair.split(":") for pair in core[-1].group(1).split(",") if ":" in pair)}
    if codes:
        name, code = next(iter(codes.items()))
        return f"engine core ({name}) {describe_exit(code)}{during}"
    if fatal:
        return f"an engine process {_fatal_exit(fatal)}{during}"
    if _CORE_EXITED in log_text:
        return "engine core exited unexpectedly"
    return None


def own_log_paths() -> list[str]:
    """The files this process's stdout and stderr go to (Ray's worker-*.out / .err for a
    replica; its engine processes inherit them)."""
    paths = []
    for fd in (1, 2):
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if path.startswith("/") and os.path.isfile(path) and path not in paths:
            paths.append(path)
    return paths


def _read_from(path: str, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(offset, size - MAX_LOG_BYTES))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def engine_core_processes(engine_client) -> list:
    """An AsyncLLM's EngineCore processes (multiprocessing children of this process)."""
    manager = getattr(getattr(getattr(engine_client, "engine_core", None), "resources", None),
                      "engine_manager", None)
    return list(getattr(manager, "processes", None) or [])


def engine_core_exit_codes(engine_client) -> dict[str, int | None]:
    """Exit codes of an AsyncLLM's EngineCore processes (children of this process)."""
    return {proc.name: proc.exitcode for proc in engine_core_processes(engine_client)}


class EngineDiedError(EngramRayError):
    """An engine died; the message is `EngineDeath.line()`. Raised by a replica's start and
    health check (Serve shows it and restarts the replica) and by `engram-ray local`."""


@dataclass(frozen=True)
class EngineDeath:
    """One engine's death, as the replica saw it."""

    engine: str      # e.g. group-0-r1
    cause: str       # explain()'s text
    phase: str       # "while starting" | "while serving"
    log_path: str | None
    at: float        # time.time()

    def line(self) -> str:
        where = f"; see {self.log_path}" if self.log_path else ""
        return f"engine {self.engine} died {self.phase}: {self.cause}{where}"


def record_death(folder: Path, replica_id: str, death: EngineDeath) -> None:
    """Write the record, unless the deployment's store folder is gone (its application was
    deleted while this replica stopped: a record then would outlive the deployment)."""
    if not folder.parent.is_dir():
        return
    private_dir(folder, "engine deaths folder")
    tmp = folder / f".{replica_id}.tmp"
    tmp.write_text(json.dumps(asdict(death)))
    os.replace(tmp, folder / f"{replica_id}.json")


def read_deaths(folder: Path, since: float = 0.0) -> list[EngineDeath]:
    """Recorded deaths at or after `since`, oldest first (unreadable records skipped)."""
    deaths = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            death = EngineDeath(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue
        if death.at >= since:
            deaths.append(death)
    return sorted(deaths, key=lambda d: d.at)



class EngineWatch:
    """A replica's watch on its engine: its log from just before the engine started, the
    EngineCore exit codes, and where deaths are recorded (`deaths_dir`)."""

    def __init__(self, engine: str, replica_id: str, folder: Path):
        self.engine, self.replica_id, self.folder = engine, replica_id, folder
        self.offsets = {path: os.path.getsize(path) for path in own_log_paths()}

    def find(self, phase: str, engine_client=None) -> EngineDeath | None:
        """The engine's death if its log or processes show one."""
        texts = {path: _read_from(path, offset) for path, offset in self.offsets.items()}
        cause = explain("\n".join(texts.values()), engine_core_exit_codes(engine_client))
        if cause is None:
            return None
        # The file that holds the evidence: faulthandler writes to stderr (its signal and
        # stack: looked at first), vLLM logs to stdout.
        log = next((p for p, text in reversed(texts.items()) if explain(text)), None)
        return EngineDeath(self.engine, cause, phase, log or next(iter(texts), None),
                           time.time())

    def report(self, death: EngineDeath) -> None:
        record_death(self.folder, self.replica_id, death)
