"""`engram-ray dashboards export DIR`: every file lands in DIR, Prometheus accepts the exported
config with its rules, the Grafana provisioning points at the exported dashboards, and a
non-empty DIR is refused (named) unless --force."""

import json
import shutil
import subprocess
import sys

import pytest
import yaml

from engram_ray.cli import main


def export(*args):
    return subprocess.run([sys.executable, "-m", "engram_ray.cli", "dashboards", "export", *args],
                          capture_output=True, text=True, timeout=60, cwd="/")


def test_export_writes_every_file(tmp_path):
    out = tmp_path / "obs"
    result = export(str(out), "--prometheus-url", "http://prom:9090")
    assert result.returncode == 0, result.stderr
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert files == ["grafana/dashboards/engram_memory.json",
                     "grafana/dashboards/engram_step_time.json",
                     "grafana/provisioning/dashboards/engram-ray.yml",
                     "grafana/provisioning/datasources/engram-ray.yml",
                     "prometheus/engram_alerts.yml", "prometheus/prometheus.yml"]
    assert sorted(result.stdout.split()) == sorted(str(out / f) for f in files)
    provider = yaml.safe_load((out / "grafana/provisioning/dashboards/engram-ray.yml").read_text())
    assert provider["apiVersion"] == 1
    path = provider["providers"][0]["options"]["path"]
    assert path == str((out / "grafana/dashboards").resolve())
    for name in ("engram_memory.json", "engram_step_time.json"):
        model = json.loads((out / "grafana/dashboards" / name).read_text())
        names = [v["name"] for v in model["templating"]["list"]]
        assert "cluster" in names and "job" in names
    source = yaml.safe_load(
        (out / "grafana/provisioning/datasources/engram-ray.yml").read_text())["datasources"][0]
    assert (source["type"], source["url"], source["isDefault"]) == (
        "prometheus", "http://prom:9090", True)


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool not on PATH (Debian's prometheus package: scripts/setup.sh)")
def test_exported_prometheus_config_and_rules_pass_promtool(tmp_path):
    assert main(["dashboards", "export", str(tmp_path / "obs")]) == 0
    result = subprocess.run(["promtool", "check", "config",
                             str(tmp_path / "obs/prometheus/prometheus.yml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 11 rules found" in result.stdout  # rule_files resolved beside the config


def test_non_empty_dir_is_refused_unless_force(tmp_path):
    out = tmp_path / "obs"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    result = export(str(out))
    assert result.returncode == 2
    assert result.stderr.strip() == (f"engram-ray dashboards: error: {out} is not empty; pass "
                                     "--force to write into it anyway")
    assert not (out / "prometheus").exists()
    result = export(str(out), "--force")
    assert result.returncode == 0, result.stderr
    assert (out / "mine.txt").read_text() == "keep"
    assert (out / "prometheus/engram_alerts.yml").is_file()


def test_a_file_in_place_of_dir_is_refused(tmp_path, capsys):
    (tmp_path / "f").write_text("")
    assert main(["dashboards", "export", str(tmp_path / "f")]) == 2
    assert "is not a folder" in capsys.readouterr().err


def test_dashboards_without_action_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["dashboards"])
    assert exc.value.code == 2


def test_export_runs_without_torch_or_ray(tmp_path):
    code = ("import sys\n"
            "class B:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('torch', 'ray', 'vllm', 'triton'):\n"
            "            raise ImportError(name)\n"
            "sys.meta_path.insert(0, B())\n"
            "from engram_ray.cli import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    result = subprocess.run([sys.executable, "-c", code, "dashboards", "export",
                             str(tmp_path / "obs")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "obs/prometheus/engram_alerts.yml").is_file()
