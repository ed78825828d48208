"""The peer group's FileStore rendezvous alone, on CPU processes: its cost after the last arrival.

For each P in `--sizes`, `--repeats` groups of P local processes (forkserver) pass a start
barrier, then each member constructs a `Rendezvous`, `gather`s a record the size of an shm
member's (host identity, handle type, 2 slice ranges, fingerprint) and `finish`es: no tables,
so only the rendezvous is timed. Two arrival patterns: `together` (all leave the barrier at
once, within its 20 ms poll, as `bench_peer.py rendezvous` has them) and `late` (rank P-1 leaves
`--late-s` after the others, who are all waiting by then: engines that finish loading at
different times). Per group, with arrival = just before `Rendezvous(...)` and done = after
`finish()` (wall clock, as `tables.stats()` has them):

    group_s = max over members of done - max over members of arrival

median and max over repeats; `scale` = median group_s at the largest P / at the smallest P
above 8 (18 by default). A member that is done stays alive until all are (its exit would
otherwise cost CPU beside the members still meeting). `--baseline FILE` times another rendezvous module as well, e.g. the
committed one (`git show HEAD:engram_ray/tables/rendezvous.py > /tmp/rendezvous_old.py`),
the two interleaved repeat by repeat so both meet the same machine noise. Every group must end
with each member holding P records and the store file removed.

Targets (issue #44 item 1, 2 cores): P=72 at most 0.2 s; P=72 / P=18 at most 5x.

Usage: python benchmarks/bench_rendezvous.py [--sizes 8,18,36,72] [--repeats 5] [--late-s 0.3]
       [--baseline /tmp/rendezvous_old.py] [--store-root /dev/shm] [--results DIR]
       (default benchmarks/results/rendezvous: latest.md, history.jsonl; the commit written is
       $ENGRAM_COMMIT, else HEAD)
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from engram_ray.tables.local_group import file_barrier, run_group  # noqa: E402

from common import add_results_argument, environment, write_results  # noqa: E402

CURRENT = "engram_ray.tables.rendezvous"
MAX_GROUP_S, MAX_SCALE = 0.2, 5.0   # the targets at P=72, and P=72 / P=18


def load_rendezvous(module: str):
    """The module named `module` (dotted), or the file `module` (a path ending in .py)."""
    if not module.endswith(".py"):
        return importlib.import_module(module)
    spec = importlib.util.spec_from_file_location("rendezvous_baseline", module)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


def shm_like_record(rank: int) -> dict:
    """A record of an shm member's size (~250 bytes of JSON)."""
    from engram_ray.tables.backends.base import host_identity
    return dict(host_identity(), handle_types=["posix_fd"], fingerprint="f" * 16,
                slices={"1": [1000 * rank, 1000 * rank + 1000],
                        "3": [1000 * rank, 1000 * rank + 1000]})


def rendezvous_member(rank: int, module: str, size: int, store_dir: str, barrier_dir: str,
                      late_s: float, timeout_s: float) -> dict:
    """Start barrier (rank size-1 then waits `late_s`), then one whole rendezvous; arrival and
    done times (wall clock)."""
    rendezvous = load_rendezvous(module)
    record = shm_like_record(rank)
    file_barrier(barrier_dir, "start", rank, list(range(size)))
    if rank == size - 1:
        time.sleep(late_s)
    arrived_at = time.time()
    meeting = rendezvous.Rendezvous(store_dir, os.path.basename(store_dir), size, rank,
                                    timeout_s)
    records = meeting.gather(record)
    meeting.finish()
    done_at = time.time()
    if [r["rank"] for r in records] != list(range(size)):
        raise RuntimeError(f"rank {rank} gathered ranks {[r['rank'] for r in records]}")
    hold_until_all_done(barrier_dir, rank, size)
    return {"arrived_at": arrived_at, "done_at": done_at}


def hold_until_all_done(barrier_dir: str, rank: int, size: int) -> None:
    """NOTES: a member that returns exits (interpreter and torch teardown, some ms of CPU);
    on 2 cores P exits would land on the members still meeting. `file_barrier` would too: it
    stats all P files every 20 ms in every member. So: one `done-<rank>` file, then one
    listdir every 50 ms until all P are there."""
    open(os.path.join(barrier_dir, f"done-{rank}"), "w").close()
    deadline = time.monotonic() + 120
    while sum(name.startswith("done-") for name in os.listdir(barrier_dir)) < size:
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: not all {size} members finished within 120 s")
        time.sleep(0.05)


def time_group(module: str, size: int, late_s: float, store_dir: str, timeout_s: float) -> float:
    """One group of `size` processes; group_s (last arrival to last done)."""
    results = run_group(rendezvous_member, list(range(size)),
                        (module, size, store_dir, store_dir + "-barrier", late_s, timeout_s),
                        timeout_s=timeout_s + 60)
    bad = [r for r in results if not r.is_ok]
    if bad:
        raise RuntimeError(f"{module} P={size}: rank {bad[0].rank} failed:\n{bad[0].value}")
    if os.listdir(store_dir):
        raise RuntimeError(f"{module} P={size}: {store_dir} still holds "
                           f"{sorted(os.listdir(store_dir))}: the last member must remove them")
    times = [r.value for r in results]
    return max(t["done_at"] for t in times) - max(t["arrived_at"] for t in times)


def summary(group_s: list[float]) -> dict:
    return {"median_s": statistics.median(group_s), "max_s": max(group_s),
            "group_s": group_s}


def bench(modules: dict[str, str], arrivals: dict[str, float], sizes: list[int], repeats: int,
          store_root: str, timeout_s: float) -> dict:
    """{arrival: {label: {P: summary}}}; the modules interleaved within each repeat."""
    found = {arrival: {label: {size: [] for size in sizes} for label in modules}
             for arrival in arrivals}
    with tempfile.TemporaryDirectory(dir=store_root) as root:
        for arrival, late_s in arrivals.items():
            for size in sizes:
                for rep in range(repeats):
                    for label, module in modules.items():
                        store_dir = os.path.join(root, f"{arrival}-{label}-{size}-{rep}")
                        seconds = time_group(module, size, late_s, store_dir, timeout_s)
                        found[arrival][label][size].append(seconds)
                        print(f"{arrival} {label} P={size} repeat {rep}: {seconds:.3f} s",
                              flush=True)
    return {arrival: {label: {str(size): summary(times) for size, times in by_size.items()}
                      for label, by_size in by_label.items()}
            for arrival, by_label in found.items()}


def scale(by_size: dict, sizes: list[int]) -> float:
    """Median group_s at the largest P over that at the smallest P above 8 (else smallest)."""
    low = min((s for s in sizes if s > 8), default=min(sizes))
    return by_size[str(max(sizes))]["median_s"] / by_size[str(low)]["median_s"]


def size_table(by_label: dict, sizes: list[int]) -> list[str]:
    """Markdown rows: P, median and max group_s per module, the ratio of the two medians."""
    labels = list(by_label)
    pair = len(labels) == 2
    lines = ["| P | " + " | ".join(f"{lab} median s | {lab} max s" for lab in labels)
             + (f" | {labels[1]} / {labels[0]} (median) |" if pair else " |"),
             "| --- |" + " --- | --- |" * len(labels) + (" --- |" if pair else "")]
    for size in sizes:
        rows = [by_label[lab][str(size)] for lab in labels]
        cells = " | ".join(f"{r['median_s']:.3f} | {r['max_s']:.3f}" for r in rows)
        ratio = f" | {rows[1]['median_s'] / rows[0]['median_s']:.2f}x |" if pair else " |"
        lines.append(f"| {size} | {cells}{ratio}")
    return lines


def fmt_load(load: tuple[float, float, float]) -> str:
    return "/".join(f"{x:.1f}" for x in load)


def rendezvous_markdown(report: dict) -> str:
    env, sizes = report["env"], report["sizes"]
    lines = ["# Peer-group rendezvous alone: last arrival to last done (CPU processes)", "",
             f"Device {env['device']}; date {env['date']}; commit {env['commit']}; store on "
             f"{report['store_root']}; {report['repeats']} groups per P, arrival pattern and "
             "module, the modules interleaved; load average (1, 5, 15 min) before "
             f"{fmt_load(report['loadavg_before'])}, after {fmt_load(report['loadavg_after'])}.",
             "", f"Command: `{report['command']}`", ""]
    for arrival, late_s in report["arrivals"].items():
        by_label = report["results"][arrival]
        title = ("all leave the start barrier together" if not late_s else
                 f"rank P-1 arrives {late_s:g} s after the others")
        lines += [f"## Arrivals `{arrival}`: {title}", "", *size_table(by_label, sizes), "",
                  "Scale (median at the largest P / at the smallest P above 8): " + ", ".join(
                      f"{lab} {report['scale'][arrival][lab]:.1f}x" for lab in by_label) + ".",
                  ""]
    lines += [f"Targets (issue #44 item 1): P=72 at most {MAX_GROUP_S:g} s, P=72 / P=18 at most "
              f"{MAX_SCALE:g}x. group_s = max(done) - max(arrival) over the members: the "
              "rendezvous itself after the last member arrived (its construction, the gather "
              "of every record, the mapped barrier, the store file's removal); no tables are "
              "opened, and members that are done stay alive until all are, so that no exit "
              "lands on the members still meeting."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="8,18,36,72", help="group sizes, e.g. 8,18,36,72")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--late-s", type=float, default=0.3,
                        help="how late rank P-1 arrives in the `late` pattern (0: no `late`)")
    parser.add_argument("--baseline", help="another rendezvous module file to time beside the "
                        "checkout's, e.g. the committed one from `git show`")
    parser.add_argument("--store-root", default="/dev/shm", help="where the stores go (tmpfs)")
    parser.add_argument("--timeout-s", type=float, default=120, help="rendezvous timeout_s")
    add_results_argument(parser, "rendezvous")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    if not sizes or min(sizes) < 2:
        parser.error(f"--sizes is {args.sizes!r}: expected group sizes of at least 2, e.g. 8,72")
    modules = {"baseline": args.baseline, "checkout": CURRENT} if args.baseline else {
        "checkout": CURRENT}
    arrivals = {"together": 0.0, **({"late": args.late_s} if args.late_s > 0 else {})}
    load_before = os.getloadavg()
    results = bench(modules, arrivals, sizes, args.repeats, args.store_root, args.timeout_s)
    env = environment()
    # The host may be shared: other work's load shows here (this run's own P processes too).
    report = {"env": env, "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "sizes": sizes, "repeats": args.repeats, "arrivals": arrivals,
              "store_root": args.store_root, "command": " ".join(["python"] + sys.argv),
              "baseline": args.baseline, "results": results,
              "scale": {arrival: {label: scale(by_size, sizes)
                                  for label, by_size in by_label.items()}
                        for arrival, by_label in results.items()}}
    text = rendezvous_markdown(report)
    print(text)
    write_results(args.results, report, text, env=env)


if __name__ == "__main__":
    main()
