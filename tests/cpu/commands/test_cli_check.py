"""`engram-ray check FILE...` over every file in cluster_configs/ (all OK) and broken copies of
each kind (FAILED naming the field, exit 1), the kind told from the content alone."""

import copy
from pathlib import Path

import pytest
import yaml

from engram_ray.cli import main

CONFIGS = Path(__file__).resolve().parents[3] / "cluster_configs"
ALL = sorted(CONFIGS.glob("*.yaml")) + sorted((CONFIGS / "kuberay").glob("*.yaml"))


def check(capsys, *paths):
    code = main(["check", *map(str, paths)])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(paths), lines
    return code, lines


def test_every_shipped_file_passes_with_its_kind(capsys):
    assert len(ALL) >= 6
    code, lines = check(capsys, *ALL)
    assert code == 0, lines
    kinds = {}
    for path, line in zip(ALL, lines):
        assert line.startswith(f"OK {path} ("), line
        kinds[path.name] = line.split("(", 1)[1].split(":")[0]
    assert kinds == {"ray_up_gb300_nvl72.yaml": "ray up", "ray_up_onprem.yaml": "ray up",
                     "serve_deepseek_v41_flash.yaml": "Serve", "serve_local_tiny.yaml": "Serve",
                     "rayservice_gb300_nvl72.yaml": "KubeRay RayService dsv41-flash-gb300",
                     "rayservice_hgx_h200.yaml": "KubeRay RayService dsv41-flash-h200"}


def _serve_break(data):
    data["applications"][0]["args"]["deployment"]["peer_group_sise"] = 8


def _kuberay_break(docs):
    for doc in docs:
        if doc["kind"] == "RayService":
            serve = yaml.safe_load(doc["spec"]["serveConfigV2"])
            _serve_break(serve)
            doc["spec"]["serveConfigV2"] = yaml.safe_dump(serve)
    return docs


BROKEN = [
    ("serve_deepseek_v41_flash.yaml", _serve_break,
     ": applications[0].args: deployment: peer_group_sise: is not a known setting"),
    ("serve_local_tiny.yaml", lambda d: d["applications"][0].pop("import_path"),
     ": applications.0.import_path: Field required"),
    ("ray_up_gb300_nvl72.yaml", lambda d: d.update(max_wrokers=3), ": top level: Additional"),
    ("ray_up_onprem.yaml", lambda d: d.update(setup_commands=["pip install vllm"]),
     ": setup_commands: do not install engram-ray[gpu]"),
]


@pytest.mark.parametrize("name,breaks,message", BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_copy_fails_naming_the_field(tmp_path, capsys, name, breaks, message):
    data = copy.deepcopy(yaml.safe_load((CONFIGS / name).read_text()))
    breaks(data)
    broken = tmp_path / name
    broken.write_text(yaml.safe_dump(data))
    code, [line] = check(capsys, broken)
    assert code == 1
    assert line.startswith(f"FAILED {broken}{message}"), line


@pytest.mark.parametrize("name", ["rayservice_gb300_nvl72.yaml", "rayservice_hgx_h200.yaml"])
def test_broken_kuberay_serve_config_fails_naming_the_field(tmp_path, capsys, name):
    docs = _kuberay_break(list(yaml.safe_load_all((CONFIGS / "kuberay" / name).read_text())))
    broken = tmp_path / name
    broken.write_text(yaml.safe_dump_all(docs))
    code, [line] = check(capsys, broken)
    assert code == 1
    assert line.startswith(f"FAILED {broken}: RayService "), line
    assert ": spec.serveConfigV2: applications[0].args: deployment: peer_group_sise: is not a " \
           "known setting" in line


def _kuberay_with(name: str, deployment: dict, unmount_store_in: str | None = None) -> list:
    """The shipped manifest `name` with `deployment` keys set in every application, and the
    store volume unmounted from the pods of `unmount_store_in` ('head' or a worker group)."""
    docs = list(yaml.safe_load_all((CONFIGS / "kuberay" / name).read_text()))
    for doc in docs:
        if doc.get("kind") != "RayService":
            continue
        serve = yaml.safe_load(doc["spec"]["serveConfigV2"])
        for app in serve["applications"]:
            app["args"]["deployment"].update(deployment)
        doc["spec"]["serveConfigV2"] = yaml.safe_dump(serve)
        cluster = doc["spec"]["rayClusterConfig"]
        pods = {"head": cluster["headGroupSpec"]["template"],
                **{w["groupName"]: w["template"] for w in cluster["workerGroupSpecs"]}}
        if unmount_store_in is not None:
            ray_container = pods[unmount_store_in]["spec"]["containers"][0]
            ray_container["volumeMounts"] = [m for m in ray_container["volumeMounts"]
                                             if m["name"] != "store"]
    return docs


def test_a_store_groups_span_hosts_with_must_be_on_one_claim_in_every_pod(tmp_path, capsys):
    """#43 item 5: where a group spans pods (handle_type fabric, or more GPUs than a pod has)
    `peer_group_store` must be on one claim the head and every GPU worker mount; a group on
    one host needs nothing shared."""
    gb300 = CONFIGS / "kuberay" / "rayservice_gb300_nvl72.yaml"
    code, [line] = check(capsys, gb300)
    assert code == 0 and "store shared on claim engram-store" in line, line
    workers = [w["groupName"] for d in yaml.safe_load_all(gb300.read_text())
               if d.get("kind") == "RayService"
               for w in d["spec"]["rayClusterConfig"]["workerGroupSpecs"]]
    cases = [("rayservice_gb300_nvl72.yaml", {}, workers[0], "handle_type fabric"),
             ("rayservice_gb300_nvl72.yaml", {"peer_group_store": "/tmp/engram-ray/store"},
              None, "handle_type fabric"),
             ("rayservice_hgx_h200.yaml", {"peer_group_size": 16, "peer_group_store":
                                           "/tmp/engram-ray/store"}, None,
              "a group's 16 GPUs are more than the 8 of one pod")]
    for i, (name, deployment, unmount, reason) in enumerate(cases):
        broken = tmp_path / f"{i}-{name}"
        broken.write_text(yaml.safe_dump_all(_kuberay_with(name, deployment, unmount)))
        code, [line] = check(capsys, broken)
        assert code == 1, line
        assert ": deployment.peer_group_store: is " in line and reason in line, line
        assert "not on one shared volume" in line and "persistentVolumeClaim" in line, line
    one_host = tmp_path / "one-host.yaml"  # posix_fd, 8 GPUs a pod: a local path is enough
    one_host.write_text(yaml.safe_dump_all(_kuberay_with(
        "rayservice_hgx_h200.yaml", {"peer_group_store": "/tmp/engram-ray/store"})))
    code, [line] = check(capsys, one_host)
    assert code == 0 and "store" not in line.split("(", 1)[1], line


def test_a_serve_yaml_says_where_its_store_must_be_shared(tmp_path, capsys):
    code, [line] = check(capsys, CONFIGS / "serve_deepseek_v41_flash.yaml")
    assert code == 0 and "where a group's NVLink domain spans hosts (handle_type unset): " \
        "deepseek-v41-flash (/mnt/shared/engram-ray/store)" in line, line
    code, [line] = check(capsys, CONFIGS / "serve_local_tiny.yaml")  # shm: one host
    assert code == 0 and "peer_group_store" not in line, line


def test_engine_kwargs_typo_names_the_nearest_valid_key(tmp_path, capsys):
    pytest.importorskip("vllm", reason="engine_kwargs names are checked against vLLM's")
    data = yaml.safe_load((CONFIGS / "serve_local_tiny.yaml").read_text())
    data["applications"][0]["args"].setdefault("serving", {}).setdefault(
        "engine_kwargs", {})["gpu_memory_utilisation"] = 0.9
    broken = tmp_path / "typo.yaml"
    broken.write_text(yaml.safe_dump(data))
    code, [line] = check(capsys, broken)
    assert code == 1 and "gpu_memory_utilisation" in line and "gpu_memory_utilization" in line


def test_other_files_fail_with_a_reason(tmp_path, capsys):
    not_yaml = tmp_path / "bad.yaml"
    not_yaml.write_text("a: [1, 2\n")
    other = tmp_path / "prom.yml"
    other.write_text("global: {scrape_interval: 15s}\n")
    pvc_only = tmp_path / "pvc.yaml"
    pvc_only.write_text("apiVersion: v1\nkind: PersistentVolumeClaim\nmetadata: {name: x}\n")
    no_serve = tmp_path / "rs.yaml"
    no_serve.write_text("apiVersion: ray.io/v1\nkind: RayService\nmetadata: {name: rs}\n"
                        "spec: {}\n")
    missing = tmp_path / "missing.yaml"
    code, lines = check(capsys, CONFIGS / "serve_local_tiny.yaml", not_yaml, other, pvc_only,
                        no_serve, missing)
    assert code == 1
    assert lines[0].startswith("OK ")
    assert lines[1].startswith(f"FAILED {not_yaml}: is not valid YAML")
    assert lines[2].startswith(f"FAILED {other}: top level: is none of the kinds")
    assert lines[3] == (f"FAILED {pvc_only}: kind: no RayService among the documents "
                        "(PersistentVolumeClaim) (expected one document with kind: RayService)")
    assert lines[4].startswith(f"FAILED {no_serve}: RayService rs: spec.serveConfigV2: is missing")
    assert lines[5] == f"FAILED {missing}: cannot be read (No such file or directory)"


def test_no_file_is_a_usage_error():
    with pytest.raises(SystemExit) as exc:
        main(["check"])
    assert exc.value.code == 2


BLOCKED_RUN = """
import sys
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "ray", "vllm", "triton"):
            raise ImportError(f"No module named {name!r} (blocked by the test)")
sys.meta_path.insert(0, Blocker())
from engram_ray.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_without_ray_each_file_fails_with_what_to_install():
    import subprocess
    import sys

    files = [str(CONFIGS / "serve_local_tiny.yaml"), str(CONFIGS / "ray_up_onprem.yaml")]
    result = subprocess.run([sys.executable, "-c", BLOCKED_RUN, "check", *files],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2 and "Traceback" not in result.stderr
    for path, line in zip(files, lines):
        assert line.startswith(f"FAILED {path}: checking needs Ray Serve's schemas"), line
        assert line.endswith("install engram-ray[cpu] or engram-ray[gpu]"), line
