"""Rows, targets and tables of benchmarks/bench_model_lookup.py (pure Python).

Targets (issue 17), printed as pass/fail: in every case `vllm_ms / patch_ms >= 1` (host
tables: `vllm_ms` is the faster of vLLM's unsorted and sorted launches); HBM lookups of at
least 1M rows, GPU time and eager: `patch_ms <= 1.03 x kernel_ms`; host time per call of the
patch path at most 20 us. Cases of the dense host table (`dense`: a table a quarter of the
size, so each lookup reads 4x the share of its rows) are reported beside the targets, with
their own worst ratio, not in them: host memory holds tables too large for HBM
(docs/lookup_experiments.md, "Pinned host tables: ordering or gather, three levers, lookup
density").
"""

from __future__ import annotations

import json
from pathlib import Path

from common import environment, write_results

MODES = ("gpu", "eager", "graph")
HOST_US_MAX = 20.0
PATCH_OVER_KERNEL_MAX = 1.03


def case_rows(placement: str, out: str, rows: int, timed: dict, equal: bool,
              table_gib: int, dense: bool = False) -> list[dict]:
    """One JSON case per mode from `{mode: {name: stats}}`."""
    found = []
    for mode in MODES:
        median = {name: s["median_ms"] for name, s in timed[mode].items()}
        row = dict(placement=placement, out=out, rows=rows, mode=mode, table_gib=table_gib,
                   vllm_ms=min(median.get("vllm", float("inf")),
                               median.get("vllm_sorted", float("inf"))),
                   kernel_ms=median["kernel"], patch_ms=median["patch"],
                   bitwise_equal_vllm=bool(equal),
                   p99_ms={name: s["p99_ms"] for name, s in timed[mode].items()})
        if "vllm_sorted" in median:  # unsorted: None where left out (bench_model_lookup)
            row.update(vllm_unsorted_ms=median.get("vllm"), vllm_sorted_ms=median["vllm_sorted"])
        if "vllm_again" in median:  # vLLM timed against itself (A/A)
            row["vllm_again_ms"] = median["vllm_again"]
        spreads = {name: [s["p10_ms"], s["p90_ms"]] for name, s in timed[mode].items()
                   if "p10_ms" in s}
        if spreads:
            row["p10_p90_ms"] = spreads
        if dense:
            row["dense"] = True
        found.append(row)
    return found


def check_targets(cases: list[dict], host_us: dict, vllm: str) -> list[dict]:
    """Each target with pass/fail and its worst case (the dense host table's cases apart)."""
    cases = [c for c in cases if not c.get("dense")]
    slowest = min(cases, key=lambda c: c["vllm_ms"] / c["patch_ms"])
    big_hbm = [c for c in cases if c["placement"] == "hbm" and c["rows"] >= 1 << 20
               and c["mode"] in ("gpu", "eager")]
    worst_hbm = max(big_hbm, key=lambda c: c["patch_ms"] / c["kernel_ms"], default=None)
    equal = all(c["bitwise_equal_vllm"] for c in cases)
    return [
        dict(target=f"patch no slower than vLLM {vllm} (every case)",
             passed=slowest["vllm_ms"] / slowest["patch_ms"] >= 1.0,
             worst=_label(slowest), value=round(slowest["vllm_ms"] / slowest["patch_ms"], 3)),
        dict(target="HBM >= 1M rows, gpu + eager: patch within 3% of the kernel alone",
             passed=None if worst_hbm is None  # not run (--placements without hbm)
             else worst_hbm["patch_ms"] <= PATCH_OVER_KERNEL_MAX * worst_hbm["kernel_ms"],
             worst=_label(worst_hbm) if worst_hbm else None,
             value=round(worst_hbm["patch_ms"] / worst_hbm["kernel_ms"], 3) if worst_hbm
             else None),
        dict(target="host time per call of the patch path <= 20 us", passed=host_us["patch"]
             <= HOST_US_MAX, worst=None, value=round(host_us["patch"], 1)),
        dict(target="outputs bitwise equal to vLLM's", passed=equal, worst=None, value=equal),
    ]


def dense_worst(cases: list[dict]) -> dict | None:
    """The dense host table's slowest case against vLLM (reported, not a target)."""
    dense = [c for c in cases if c.get("dense")]
    if not dense:
        return None
    worst = min(dense, key=lambda c: c["vllm_ms"] / c["patch_ms"])
    return dict(worst=_label(worst), value=round(worst["vllm_ms"] / worst["patch_ms"], 3),
                cases_below_1=sum(c["vllm_ms"] < c["patch_ms"] for c in dense),
                cases=len(dense))


def _label(case: dict) -> str:
    return f"{_place(case)} {case['out']} {case['rows']} rows {case['mode']}"


def _place(case: dict) -> str:
    """The placement, with its table size for the dense host table."""
    if case.get("dense"):
        return f"{case['placement']} {case['table_gib']} GiB (dense)"
    return case["placement"]


def finish(cases: list[dict], host: list[dict], args) -> dict:
    """The run's result: cases, host times, targets, the environment (benchmarks/common.py:
    device, date, commit, torch, Triton) and the table sizes."""
    host_us = {name: max(h[name] for h in host if name in h)
               for name in ("vllm", "kernel", "patch", "patch_unfused")
               if any(name in h for h in host)}
    return dict(cases=cases, host_us=host_us, host_us_cases=host,
                targets=check_targets(cases, host_us, args.vllm),
                dense_host=dense_worst(cases), vllm=args.vllm,
                **environment(gpu=True), placements=args.placements,
                hbm_gib=args.hbm_gib, host_gib=args.host_gib,
                dense_host_gib=args.dense_host_gib, budget_s=args.budget_s)


def markdown(result: dict) -> str:
    vllm = f"vLLM {result.get('vllm', '0.33')}"  # runs before --vllm used 0.33's kernel
    lines = [f"# Engram lookup as the model calls it vs {vllm} ({result['device']})", "",
             f"{result['date']}, commit {result['commit']}, torch {result['torch']}, Triton "
             f"{result['triton']}; tables: HBM and peer {result['hbm_gib']} GiB (peer: two "
             f"slices on one GPU), pinned host {result['host_gib']} GiB"
             + (f" and, dense, {result['dense_host_gib']} GiB" if result.get("dense_host_gib")
                else "") + "; 24 columns per token, "
             "uniform random ids. Medians in ms; `x` = vLLM / patch. Host tables: vLLM = "
             "faster of unsorted / sorted (both in the JSON; unsorted timed in gpu mode only where "
             "it is 1.5x slower there). gpu = device events, launches "
             "queued; eager = one call + sync (host clock); graph = CUDA-graph replay + sync."
             + (f" Placements in this run: {', '.join(result['placements'])}."
                if result.get("placements", ["hbm", "peer", "host"]) != ["hbm", "peer", "host"]
                else ""),
             "", f"| placement | out | rows | mode | {vllm} | kernel alone | patch | x | "
             "patch / kernel | bitwise = vLLM |", "| --- | --- | ---: | --- | ---: | ---: | "
             "---: | ---: | ---: | --- |"]
    for c in result["cases"]:
        lines.append(f"| {_place(c)} | {c['out']} | {c['rows']:,} | {c['mode']} | "
                     f"{c['vllm_ms']:.4f} | {c['kernel_ms']:.4f} | {c['patch_ms']:.4f} | "
                     f"{c['vllm_ms'] / c['patch_ms']:.2f} | {c['patch_ms'] / c['kernel_ms']:.3f}"
                     f" | {'yes' if c['bitwise_equal_vllm'] else 'NO'} |")
    lines += _spread_lines(result["cases"])
    lines += ["", "Host time per call (us; back to back, GPU held by a sleep kernel; best of "
              "the rounds, their median after the slash where the run kept it; every id set "
              "met before, as vLLM's staging buffers are; `patch, unfused`: the launcher with "
              "no fused graphs, i.e. ids and output at new addresses):", "",
              f"| placement | out | rows | {vllm} | {vllm}, sorted | kernel alone | patch | "
              "patch, unfused |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for h in result["host_us_cases"]:
        cells = " | ".join(_host_cell(h, name) for name in ("vllm", "vllm_sorted", "kernel",
                                                             "patch", "patch_unfused"))
        lines.append(f"| {_place(h)} | {h['out']} | {h['rows']:,} | {cells} |")
    if any("rounds_not_held" in h for h in result["host_us_cases"]):
        lost = sum(h.get("rounds_not_held", 0) for h in result["host_us_cases"])
        lines += ["", f"Rounds in which the sleep kernel had ended before the timed calls did "
                  f"(the host may have waited on the GPU): {lost}."]
    lines += ["", "Targets:", ""]
    for t in result["targets"]:
        worst = f" (worst: {t['worst']})" if t["worst"] else ""
        lines.append(f"- {_verdict(t)}: {t['target']}: {t['value']}{worst}")
    dense = result.get("dense_host")
    if dense:
        lines.append(f"- Beside the targets, the dense host table: vLLM / patch >= 1 in "
                     f"{dense['cases'] - dense['cases_below_1']} of {dense['cases']} cases; "
                     f"worst {dense['value']} ({dense['worst']})")
    return "\n".join(lines) + "\n"


def _verdict(target: dict) -> str:
    return {True: "PASS", False: "FAIL", None: "NOT RUN"}[target["passed"]]


def _host_cell(h: dict, name: str) -> str:
    """One callable's host time: best of the rounds, " / median" where the run kept it."""
    if name not in h:
        return "-"
    median = h.get("median", {})
    return f"{h[name]:.1f}" + (f" / {median[name]:.1f}" if name in median else "")


def _spread_lines(cases: list[dict]) -> list[str]:
    """Host-clock modes where vLLM was also timed against itself, and every case slower than
    vLLM: medians with p10-p90 in us."""
    def cell(case, name, median_key):
        low, high = case["p10_p90_ms"][name]
        return f"{1e3 * case[median_key]:.1f} ({1e3 * low:.1f}-{1e3 * high:.1f})"

    shown = [c for c in cases if "p10_p90_ms" in c
             and ("vllm_again_ms" in c or c["vllm_ms"] < c["patch_ms"])]
    if not shown:
        return []
    lines = ["", "Host-clock samples (us, median (p10-p90)), taken in turn: small lookups "
             "(with vLLM timed against itself, `vLLM again`) and every case where the patch's "
             "median is above vLLM's:", "",
             "| placement | out | rows | mode | vLLM | vLLM again | patch | patch / vLLM |",
             "| --- | --- | ---: | --- | --- | ---: | --- | ---: |"]
    for c in shown:
        vllm_name = "vllm_sorted" if c.get("vllm_sorted_ms") == c["vllm_ms"] else "vllm"
        again = f"{1e3 * c['vllm_again_ms']:.1f}" if "vllm_again_ms" in c else "-"
        lines.append(f"| {_place(c)} | {c['out']} | {c['rows']:,} | {c['mode']} | "
                     f"{cell(c, vllm_name, 'vllm_ms')} | {again} | "
                     f"{cell(c, 'patch', 'patch_ms')} | {c['patch_ms'] / c['vllm_ms']:.3f} |")
    return lines


def summary(result: dict) -> str:
    text = [f"host_us {json.dumps({k: round(v, 1) for k, v in result['host_us'].items()})}"]
    text += [f"{_verdict(t)} {t['target']}: {t['value']} {t['worst'] or ''}"
             for t in result["targets"]]
    if result.get("dense_host"):
        text.append(f"dense host table (not a target): {json.dumps(result['dense_host'])}")
    return "\n".join(text)


def history_line(result: dict) -> dict:
    """The figures a history.jsonl line keeps (device, date and commit go first)."""
    keys = ("placement", "table_gib", "dense", "out", "rows", "mode", "vllm_ms", "kernel_ms",
            "patch_ms", "bitwise_equal_vllm")
    return dict(vllm=result.get("vllm"), host_us=result["host_us"], targets=result["targets"],
                dense_host=result.get("dense_host"),
                cases=[{k: c[k] for k in keys if k in c} for c in result["cases"]])


def write_history(result: dict, folder: Path) -> Path:
    """STYLE rule 14 (benchmarks/common.py): `folder/latest.md` and one history.jsonl line."""
    return write_results(folder, history_line(result), markdown(result), env=result)
