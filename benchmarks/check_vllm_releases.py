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


def held_slice_restart(tree: SourceTree) -> str:
    """The release's own `request_memory` (its source from the wheel, run as it is) fed the
    shipped numbers (an H200, 0.92, DeepSeek-V4.1-Flash's P=8 slice held by the replica):
    whether a restart in place fails without the held slice declared and passes with it, with
    the first start's budget less the slice (the KV cache as at the first start)."""
    from types import SimpleNamespace

    from engram_ray.model.layout import load_layout
    from engram_ray.planning.memory import make_plan
    from gpu_held_memory import request_memory_from

    request_memory = request_memory_from(tree.text("vllm/v1/worker/utils.py"),
                                         f"{tree.label}: vllm/v1/worker/utils.py")
    total, other = int(140.4 * 2**30), 2**30
    held = make_plan(load_layout("deepseek-v4.1-flash"), "peer", peer_group_size=8
                     ).hbm_bytes_per_gpu
    # 0.34 reads resolved_gpu_memory_utilization and enable_extensible_kv_cache (off: the
    # check applies, as it does by default).
    cache = SimpleNamespace(gpu_memory_utilization=0.92, resolved_gpu_memory_utilization=0.92,
                            enable_extensible_kv_cache=False)

    def snapshot(free):
        return SimpleNamespace(total_memory=total, free_memory=free, device_="cuda:0")

    first = request_memory(snapshot(total - other), cache, 0)
    try:
        request_memory(snapshot(total - other - held), cache, 0)
        return "a restart passed without the slice declared: nothing to fix?"
    except ValueError:
        pass
    after = request_memory(snapshot(total - other - held), cache, held)
    return ("passes" if after == first - held else
            f"passes with {after} bytes, not the first start's {first} less {held}")


def check_release(release: str, cache: Path) -> dict:
    dist, version = release.split("==")
    path = wheel(release, cache)
    tree = SourceTree(path, path.name)
    findings = check_tree(tree)
    waived = WAIVED.get(dist, {})
    kernel = hashlib.sha256(kernel_text(tree.text(ENGRAM), path.name).encode()).hexdigest()
    try:
        restart = held_slice_restart(tree)
    except Exception as exc:  # noqa: BLE001 - reported per release
        restart = f"could not run: {type(exc).__name__}: {exc}"
    return dict(release=f"{dist} {version}", wheel=path.name, held_slice_restart=restart,
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
            ("`_engram_lookup_kernel` sha256", [r["lookup_kernel_sha256"] for r in results]),
            ("its `request_memory` (run from the wheel; H200, 0.92, Flash P=8 slice held): a "
             "restart in place fails without the held slice declared and, declared, passes "
             "with the first start's KV budget", [r["held_slice_restart"] for r in results])]
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
    return int(any(state == "BROKEN" for r in results for state in r["checks"].values())
               or any(r["held_slice_restart"] != "passes" for r in results))


if __name__ == "__main__":
    sys.exit(main())
