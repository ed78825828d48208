"""Why an engine died (engram_ray.serve.member.engine_death), read from real processes' output: a
process that faulthandler reports killed by a fatal signal, a replica-like process whose log
and stderr are files, and the records `engram-ray local` reads. The whole path (a vLLM worker
killed under a Serve replica) is tested in test_local_deployment.py."""

import json
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from engram_ray.serve.member.engine_death import (EngineDeath, EngineWatch, describe_exit, explain,
                                                  read_deaths, record_death)

# vLLM 0.32's multiproc executor, once a worker is ready (multiproc_executor.py)
WORKER_DIED = ("(EngineCore pid=7) ERROR [multiproc_executor.py:316] Worker proc VllmWorker-0 "
               "died unexpectedly (exit code: {code}), shutting down executor.")


def _die_in_forward(tmp_path, sig: signal.Signals) -> str:
    """stderr of a Python process with faulthandler on that takes `sig` in `forward()`."""
    code = textwrap.dedent(f"""
        import faulthandler, os, signal
        faulthandler.enable(all_threads=True)
        def execute_model():
            forward()
        def forward():
            os.kill(os.getpid(), signal.{sig.name})
        execute_model()
    """)
    err = tmp_path / "err.txt"
    with open(err, "w") as f:
        proc = subprocess.run([sys.executable, "-c", code], stderr=f, timeout=60)
    assert proc.returncode == -sig
    return err.read_text()


@pytest.mark.parametrize("sig,words", [(signal.SIGILL, "SIGILL (illegal instruction)"),
                                       (signal.SIGSEGV, "SIGSEGV (segmentation fault)")])
def test_a_fatal_signal_is_named_with_where_it_struck(tmp_path, sig, words):
    text = _die_in_forward(tmp_path, sig)
    assert explain(text) == f"an engine process exited with {words} during a forward pass"
    # Before it is ready, vLLM says only that the worker's start failed.
    text += "\nException: WorkerProc initialization failed due to an exception in a background"
    assert explain(text) == f"worker exited with {words} during a forward pass"


def test_exit_codes_are_described():
    assert describe_exit(-4) == "exited with SIGILL (illegal instruction)"
    assert describe_exit(-9) == "exited with SIGKILL (killed: out of memory, or by hand)"
    assert describe_exit(1) == "exited with code 1"
    assert explain(WORKER_DIED.format(code=-4)) == "worker exited with SIGILL (illegal instruction)"
    assert explain("RuntimeError: Engine core initialization failed. See root cause above. "
                   "Failed core proc(s): {'EngineCore_DP0': -9}") == (
        "engine core (EngineCore_DP0) exited with SIGKILL (killed: out of memory, or by hand)")
    assert explain("INFO loading weights\nINFO ready") is None


def test_watch_reads_only_what_its_engine_wrote_and_records_it(tmp_path):
    """A replica-like process (stdout and stderr are files, as under Ray) starts a watch, its
    'engine' dies, and the death lands in the records folder with the evidence's file."""
    out, err = tmp_path / "worker.out", tmp_path / "worker.err"
    out.write_text(WORKER_DIED.format(code=-11) + "\n")  # an earlier engine's death
    code = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from engram_ray.serve.member.engine_death import EngineWatch
        watch = EngineWatch("group-0-r1", "replica-a", Path({str(tmp_path / "deaths")!r}))
        assert watch.find("while starting") is None, "read what was there before it"
        print({WORKER_DIED.format(code=-4)!r}, flush=True)
        death = watch.find("while starting")
        watch.report(death)
        print("LINE", death.line(), file=sys.stderr)
    """)
    with open(out, "a") as stdout, open(err, "w") as stderr:
        subprocess.run([sys.executable, "-c", code], stdout=stdout, stderr=stderr, timeout=60,
                       check=False)
    assert "LINE engine group-0-r1 died while starting: worker exited with SIGILL " \
           f"(illegal instruction); see {out}" in err.read_text(), err.read_text()
    [death] = read_deaths(tmp_path / "deaths")
    assert (death.engine, death.log_path) == ("group-0-r1", str(out))


def test_records_since_a_time_and_unreadable_ones_skipped(tmp_path):
    folder = tmp_path / "deaths"
    old = EngineDeath("group-0-r0", "worker exited with code 1", "while serving", None, 100.0)
    new = EngineDeath("group-0-r1", "worker exited with code 1", "while serving", None,
                      time.time())
    record_death(folder, "a", old)
    record_death(folder, "b", new)
    (folder / "c.json").write_text("{not json")
    (folder / "d.json").write_text(json.dumps({"engine": "x"}))
    assert read_deaths(folder) == [old, new]
    assert read_deaths(folder, since=new.at) == [new]
    assert read_deaths(tmp_path / "missing") == []
    assert EngineWatch("e", "r", folder).find("while serving") is None  # pytest's own fds
