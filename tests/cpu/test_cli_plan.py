"""`engram-ray plan` through the installed console script: output, JSON and one-line errors."""

import json
import subprocess

import pytest


def run_cli(*args):
    return subprocess.run(["engram-ray", *args], capture_output=True, text=True, timeout=120)


def test_plan_table_and_compare():
    result = run_cli("plan", "--model", "deepseek-v4.1-flash", "--placement", "peer",
                     "--peer-group-size", "8", "--compare")
    assert result.returncode == 0, result.stderr
    assert "188.83 GiB total" in result.stdout
    assert "23.60" in result.stdout and "94.42" in result.stdout


def test_plan_json():
    result = run_cli("plan", "--peer-group-size", "18", "--json", "--compare", "peer")
    out = json.loads(result.stdout)
    assert [t["rows"] for t in out["layout"]["tables"]] == [384006168, 384016682]
    assert out["plans"][0]["hbm_gib_per_gpu"] == 10.49
    assert out["kv_gain_bytes_per_gpu"] == 0


@pytest.mark.parametrize("args,message", [
    (["--peer-group-size", "0"], "peer_group_size: is 0"),
    (["--peer-group-size", "400000000"], "more than the"),
    (["--placement", "ssd"], "invalid choice"),
    (["--model", "nope"], "neither a preset nor a file"),
    (["--peer-group-size", "x"], "invalid int value"),
])
def test_plan_errors_are_one_line(args, message):
    result = run_cli("plan", *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) <= 2


def test_config_missing_field_and_not_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"engram_layer_ids": [0]}))
    result = run_cli("plan", "--model", str(tmp_path))
    assert result.returncode == 2 and "engram_vocab_size: is missing" in result.stderr
    (tmp_path / "config.json").write_text("[1, 2")
    result = run_cli("plan", "--model", str(tmp_path / "config.json"))
    assert result.returncode == 2 and "is not valid JSON" in result.stderr
