"""benchmarks/model_lookup_report.py: #17's targets leave the dense host table's cases out and
report them beside the targets (pure Python, no GPU)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import model_lookup_report as report  # noqa: E402


def _case(placement, rows, vllm_ms, patch_ms, table_gib, dense=False, mode="gpu"):
    medians = {"vllm": {"median_ms": vllm_ms, "p99_ms": vllm_ms},
               "kernel": {"median_ms": patch_ms, "p99_ms": patch_ms},
               "patch": {"median_ms": patch_ms, "p99_ms": patch_ms}}
    timed = {m: medians for m in report.MODES}
    return [c for c in report.case_rows(placement, "packed", rows, timed, True, table_gib,
                                        dense) if c["mode"] == mode]


def test_dense_cases_are_reported_beside_the_targets_not_in_them():
    cases = (_case("hbm", 1 << 21, 2.0, 1.0, 16) + _case("host", 1 << 21, 9.0, 8.0, 32)
             + _case("host", 1 << 21, 9.0, 9.3, 8, dense=True))
    targets = report.check_targets(cases, {"patch": 10.0}, "0.34")
    slower = next(t for t in targets if t["target"].startswith("patch no slower"))
    assert slower["target"] == "patch no slower than vLLM 0.34 (every case)"  # --vllm
    assert slower["passed"] and slower["value"] == round(9.0 / 8.0, 3)
    dense = report.dense_worst(cases)
    assert dense == dict(worst=f"host 8 GiB (dense) packed {1 << 21} rows gpu",
                         value=round(9.0 / 9.3, 3), cases_below_1=1, cases=1)


def test_a_slower_case_of_the_main_tables_fails_the_target():
    cases = _case("host", 1 << 21, 9.0, 9.3, 32) + _case("host", 1 << 21, 9.0, 8.0, 8, True)
    targets = report.check_targets(cases, {"patch": 10.0}, "0.33")
    assert not targets[0]["passed"] and targets[0]["worst"] == f"host packed {1 << 21} rows gpu"
    assert report.dense_worst(cases)["cases_below_1"] == 0


def test_unsorted_vllm_left_out_of_host_clock_modes():
    """bench_model_lookup times vLLM's unsorted host launch in GPU time only where it is far
    slower: vllm_ms is then the sorted launch's in eager and graph modes."""
    sorted_ = {"median_ms": 9.0, "p99_ms": 9.0}
    timed = {"gpu": {"vllm": {"median_ms": 80.0, "p99_ms": 80.0}, "vllm_sorted": sorted_,
                     "kernel": sorted_, "patch": {"median_ms": 8.0, "p99_ms": 8.0}}}
    for mode in ("eager", "graph"):
        timed[mode] = {k: v for k, v in timed["gpu"].items() if k != "vllm"}
    rows = {c["mode"]: c for c in report.case_rows("host", "packed", 1 << 21, timed, True, 32)}
    assert rows["gpu"]["vllm_unsorted_ms"] == 80.0 and rows["gpu"]["vllm_ms"] == 9.0
    assert rows["graph"]["vllm_unsorted_ms"] is None and rows["graph"]["vllm_ms"] == 9.0
    assert "9.0000" in report.markdown(dict(
        cases=list(rows.values()), host_us_cases=[], targets=[], device="d", date="t",
        commit="c", torch="2", triton="3", hbm_gib=16, host_gib=32))


def test_host_times_name_the_dense_table():
    """The host-time table tells the two host tables apart (both are placement "host")."""
    host = [dict(placement="host", out="packed", rows=1536, table_gib=gib, dense=dense,
                 vllm=30.0, patch=12.0) for gib, dense in ((32, False), (16, True))]
    text = report.markdown(dict(cases=[], host_us_cases=host, targets=[], device="d", date="t",
                                commit="c", torch="2", triton="3", hbm_gib=16, host_gib=32,
                                dense_host_gib=16))
    assert "| host | packed | 1,536 | 30.0 | - | - | 12.0 | - |" in text
    assert "| host 16 GiB (dense) | packed | 1,536 | 30.0 | - | - | 12.0 | - |" in text
