"""`engram-ray plan` through the installed console script: output, JSON and one-line errors."""

import json
import os
import re
import subprocess
from pathlib import Path

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


def test_compare_states_the_benefit_in_words_with_no_negative_figure():
    """The README's example: host memory freed per GPU and per node, the KV-cache cost in words."""
    result = run_cli("plan", "--placement", "peer", "--peer-group-size", "8", "--compare")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "peer P=8 against host DP=2:" in out
    assert "94.42 GiB freed per GPU, 755.33 GiB freed per node of 8 GPUs" in out
    assert "KV cache (HBM):  23.60 GiB less per GPU" in out
    assert not re.search(r"-\d", out), "a signed figure reads as a loss or a gain by accident"
    bigger = run_cli("plan", "--peer-group-size", "8", "--compare", "peer:4").stdout
    assert "peer P=8 against peer P=4:" in bigger
    assert "KV cache (HBM):  23.60 GiB more per GPU" in bigger
    assert "host memory:     the same" in bigger


def test_column_headers_are_whole():
    for args in (["--compare"], ["--compare", "host:per-engine"], ["--placement", "host",
                                                                    "--host-mode", "per-node",
                                                                    "--compare", "peer:18"]):
        lines = run_cli("plan", *args).stdout.splitlines()
        header = lines[lines.index("") + 1]
        labels = re.findall(r"\S+(?: \S+)*", header.strip())
        assert labels[0] in ("peer P=8", "host per node") and len(labels) == 2, header
        # every row's columns line up under the headings
        row = next(line for line in lines if line.startswith("HBM per GPU"))
        assert len(row) == len(header), (row, header)
        for label in labels:
            assert any(line == f"  {label}: " + line.split(": ", 1)[1] for line in lines
                       if line.startswith(f"  {label}: ")), f"no description line for {label}"


def test_compare_json_has_host_memory_freed():
    out = json.loads(run_cli("plan", "--json", "--compare").stdout)
    assert out["host_bytes_freed_per_gpu"] == out["plans"][1]["host_bytes_per_gpu"]
    assert round(out["host_bytes_freed_per_node"] / 2**30, 2) == 755.33
    assert round(out["kv_gain_bytes_per_gpu"] / 2**30, 2) == -23.60
    with pytest.raises(json.JSONDecodeError):
        json.loads(run_cli("plan", "--json", "--compare", "peer:x").stdout)


@pytest.mark.parametrize("args", [["plan", "--json"], ["plan", "--compare"], ["doctor"],
                                  ["doctor", "--json"], ["--help"], ["plan", "--help"]])
def test_closed_pipe_ends_quietly(args):
    """`engram-ray plan --json | head` with the reader gone before the first write: no
    traceback, the exit status a shell shows for SIGPIPE."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run(["engram-ray", *args], stdout=write_end,
                                stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr, result.stderr
    # argparse's --help swallows the error itself and exits 0
    assert result.returncode == (0 if "--help" in args else 141)


def test_pipe_into_head_through_a_shell():
    result = subprocess.run("engram-ray plan --json | head -n 2; echo status=${PIPESTATUS[0]}",
                            shell=True, executable="/bin/bash", capture_output=True, text=True,
                            timeout=120)
    assert result.stdout.splitlines()[:2] == ["{", '  "model": "deepseek-v4.1-flash",']
    assert result.stdout.splitlines()[-1] in ("status=0", "status=141")
    assert "Traceback" not in result.stderr


def test_version_matches_the_package():
    import tomllib

    import engram_ray

    result = run_cli("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"engram-ray {engram_ray.__version__}"
    pyproject = tomllib.loads((Path(__file__).resolve().parents[3] / "pyproject.toml")
                              .read_text())
    assert pyproject["project"]["version"] == engram_ray.__version__


def test_help_shows_every_default():
    """Every option with a default says it in --help (flags and options without one excepted)."""
    from engram_ray.cli import build_parser
    from engram_ray.commands import COMMANDS

    parser = build_parser([])
    sub = next(a for a in parser._actions if a.dest == "command")
    for name in COMMANDS:
        command = sub.choices[name]
        text = " ".join(command.format_help().split())
        for action in command._actions:
            if not action.option_strings or action.default in (None, False, "==SUPPRESS=="):
                continue
            assert f"(default: {action.default})" in text or "default" in (action.help or ""), (
                f"engram-ray {name} --help: {action.option_strings[0]} hides its default "
                f"{action.default!r}")
    plan_help = " ".join(sub.choices["plan"].format_help().split())
    assert "(default: 8)" in plan_help and "(default: peer)" in plan_help


def test_compare_prints_the_host_kv_cache_the_freed_memory_buys(tmp_path):
    """Freed host memory per GPU less the reserve, for vLLM's CPU KV-cache offloading, and the
    tokens it holds: not known for the preset (Engram fields only), from --kv-bytes-per-token
    or a config.json with attention fields."""
    out = run_cli("plan", "--compare").stdout
    assert ("host KV cache:   78.42 GiB per GPU (94.42 GiB freed - 16.00 GiB reserve) for "
            "vLLM's") in out
    assert "(serving.host_kv_cache_gib: auto)" in out and "tokens it holds: not known" in out
    freed = 384006168 * 264 + 384016682 * 264  # both tables, heads split over DP=2
    tokens = (freed // 2 - 16 * 2**30) // 4000
    out = run_cli("plan", "--compare", "--kv-bytes-per-token", "4000").stdout
    assert f"= {tokens:,} tokens of KV cache per GPU at 4,000 bytes per token" in out
    less = run_cli("plan", "--compare", "--host-reserve-gib", "40").stdout
    assert "54.42 GiB per GPU (94.42 GiB freed - 40.00 GiB reserve)" in less
    config = {"engram_layer_ids": [1, 14], "engram_vocab_size": 16000000,
              "engram_max_ngram_size": 4, "engram_n_heads": 8, "engram_head_dim": 256,
              "engram_compressed_vocab_size": 99092, "engram_pad_token_id": 2,
              "num_hidden_layers": 4, "num_key_value_heads": 8, "head_dim": 128}
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = run_cli("plan", "--model", str(tmp_path), "--compare").stdout
    per_token = 2 * 4 * 8 * 128 * 2
    assert f"= {(freed // 2 - 16 * 2**30) // per_token:,} tokens" in out
    assert f"at {per_token:,} bytes per token" in out and "4 layers x 8 KV heads" in out
    # the other way round nothing is freed, and that is said
    back = run_cli("plan", "--placement", "host", "--compare", "peer").stdout
    assert "host KV cache:   none: no host memory freed" in back


def test_compare_json_has_the_host_kv_cache():
    out = json.loads(run_cli("plan", "--json", "--compare", "--kv-bytes-per-token",
                             "1000").stdout)["host_kv_cache"]
    assert out["host_freed_gib_per_gpu"] == 94.42 and out["reserve_gib_per_gpu"] == 16.0
    assert out["host_kv_cache_gib_per_gpu"] == 78.42 and out["kv_bytes_per_token"] == 1000
    assert out["host_kv_cache_tokens_per_gpu"] > 84_000_000
    result = run_cli("plan", "--compare", "--kv-bytes-per-token", "0")
    assert result.returncode == 2 and "--kv-bytes-per-token: is 0" in result.stderr
    result = run_cli("plan", "--compare", "--host-reserve-gib", "-1")
    assert result.returncode == 2 and "--host-reserve-gib: is -1" in result.stderr
