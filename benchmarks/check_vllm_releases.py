"""Every assumption of the DeepSeek-V4.1 patch against each supported vLLM release's own wheel.

For each release (default: `<minor>.0` of every entry of `engram_ray.vllm.compat.SUPPORTED`)
the wheel is fetched once into `--cache` (`pip download --no-deps`; about 130-340 MB each, not
run in CI), the source files the checks read are read straight from the zip
(`engram_ray.vllm.assumptions`), and one table goes to `benchmarks/results/vllm_compat/`
(latest.md, one history.jsonl line; benchmarks/common.py). Beside the checks: the torch the
wheel pins and a digest of `_engram_lookup_kernel` (the anchor bench_model_lookup loads).
Exit code 1 when a release breaks an assumption that is not waived for it.

Usage: python benchmarks/check_vllm_releases.py [--cache DIR] [--releases vllm==0.34.0 ...]
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from engram_ray.vllm.assumptions import ASSUMPTIONS, ENGRAM, SourceTree, check_tree  # noqa: E402
from engram_ray.vllm.compat import SUPPORTED, WAIVED, version_problem  # noqa: E402

from common import add_results_argument, environment, write_results  # noqa: E402
from vllm_engram_ref import kernel_text  # noqa: E402


def default_releases() -> list[str]:
    return [f"{dist}=={minor}.0" for dist, minors in SUPPORTED.items() for minor in minors]


def wheel(release: str, cache: Path) -> Path:
    """The release's wheel in `cache`, downloaded once."""
    dist, version = release.split("==")
    pattern = f"{dist.replace('-', '_')}-{version}-*.whl"
    found = sorted(cache.glob(pattern))
    if not found:
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary",
                        ":all:", release, "-d", str(cache)], check=True)
        found = sorted(cache.glob(pattern))
    if not found:
        raise FileNotFoundError(f"pip download {release} left no {pattern} in {cache}")
    return found[-1]


def torch_pin(path: Path) -> str:
    """The wheel's `Requires-Dist: torch...` requirements (their platform markers dropped)."""
    with zipfile.ZipFile(path) as whl:
        [metadata] = [n for n in whl.namelist() if n.endswith(".dist-info/METADATA")]
        lines = whl.read(metadata).decode().splitlines()
    pins = {line.split(":", 1)[1].split(";")[0].strip() for line in lines
            if line.startswith("Requires-Dist: torch") and line[20:21] in "=<>!~ ;"}
    return " or ".join(sorted(pins)) or "none"


def check_release(release: str, cache: Path) -> dict:
    dist, version = release.split("==")
    path = wheel(release, cache)
    tree = SourceTree(path, path.name)
    findings = check_tree(tree)
    waived = WAIVED.get(dist, {})
    kernel = hashlib.sha256(kernel_text(tree.text(ENGRAM), path.name).encode()).hexdigest()
    return dict(release=f"{dist} {version}", wheel=path.name,
                supported=version_problem(dist, version) is None, torch=torch_pin(path),
                lookup_kernel_sha256=kernel[:12],
                checks={f.name: "holds" if f.holds else "waived" if f.name in waived
                        else "BROKEN" for f in findings},
                details={f.name: f.detail if f.name not in waived
                         else f"{f.detail} (waived: {waived[f.name]})"
                         for f in findings if not f.holds})


def markdown(results: list[dict], env: dict) -> str:
    head = "| assumption | " + " | ".join(r["release"] for r in results) + " |"
    lines = ["# The DeepSeek-V4.1 patch's assumptions against each vLLM release's wheel", "",
             f"{env['date']}, commit {env['commit']}, on {env['device']}; "
             "`python benchmarks/check_vllm_releases.py` (engram_ray/vllm/assumptions.py; "
             "sources read from each wheel, nothing vendored).", "", head,
             "| --- |" + " --- |" * len(results)]
    rows = [("version supported", ["yes" if r["supported"] else "NO" for r in results]),
            ("torch pin", [r["torch"] for r in results]),
            ("`_engram_lookup_kernel` sha256", [r["lookup_kernel_sha256"] for r in results])]
    rows += [(f"`{a.name}`: {a.assumes}", [r["checks"][a.name] for r in results])
             for a in ASSUMPTIONS]
    lines += [f"| {name} | " + " | ".join(cells) + " |" for name, cells in rows]
    notes = [f"- {r['release']}, `{name}`: {detail}" for r in results
             for name, detail in r["details"].items()]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "engram-ray"
                        / "vllm-wheels", help="folder of downloaded wheels (kept)")
    parser.add_argument("--releases", nargs="+", default=default_releases(),
                        help="dist==version, default: %(default)s")
    add_results_argument(parser, "vllm_compat")
    args = parser.parse_args()
    results = [check_release(release, args.cache) for release in args.releases]
    env = environment()
    text = markdown(results, env)
    write_results(args.results, dict(releases=results), text, env=env)
    print(text)
    return int(any(state == "BROKEN" for r in results for state in r["checks"].values()))


if __name__ == "__main__":
    sys.exit(main())
