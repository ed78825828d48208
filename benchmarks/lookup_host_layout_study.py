"""Pinned host tables at 65K-1.57M looked-up rows: page size and table layout side by side
(issue 17's last target: the patch path no slower than vLLM 0.33's sorted launch), one run.

Tables (8 GiB each, the same random rows): engram-ray's packed 264-byte rows and vLLM's split
layout (values `[rows, 256]` + scales `[rows, 8]`), each on ordinary pinned pages (torch
`pin_memory`, cudaHostAlloc) and on transparent huge pages (mmap + MADV_HUGEPAGE + prefault +
cudaHostRegister, engram_ray.tables.backends.host_memory; the machine's THP mode is read, never changed), and
packed rows 15 per 4 KiB page (`pages`: no row crosses a page; the layout is lookup_tiles'
TABLE_LAYOUT 2, at df6c8be on a 272-byte stride with 16-byte loads, since on 264).
Variants (`LookupLauncher`, int32 hashes as a column slice of `[T, 2, 24]`, fused graphs):
- `vllm_sorted` (and `vllm_sorted_again`, the same launch timed twice: the noise), its sorted
  launch on its split table; `vllm_sorted_thp` the same on huge pages;
- `dense`: today's patch path (packed rows, small pages, the policy); `dense_vgrid` with vLLM's
  grid (16-row tiles, 1 program per SM, 2 warps); `dense_thp` packed rows on huge pages with
  the small-page launch; `dense_sort`: ordered by row (torch.sort), not block;
- `split` / `split_thp` / `split_sort`: the kernel on vLLM's split table (vLLM's own memory) /
  on huge pages / ordered by row; `split_vgrid`: vLLM's grid (TABLE_LAYOUT 1: at df6c8be
  values loaded as [R, 8, 32] 16-byte vectors, since as [R, 256] 8-byte ones);
- `pages`: packed rows that never cross a page;
- unsorted (`*_unsorted`, up to 262K rows): the page-size question without ordering.
`--full` adds the huge-page tables, the by-row orderings and the unsorted launches.
GPU ms: device events, launches queued, L2 flushed, 3 rounds taking turns; bitwise equality
with vLLM's output per (rows, out). THP share of each huge-page table from /proc/self/smaps.

Usage: python benchmarks/lookup_host_layout_study.py --json R.json --md R.md [--commit C]
           [--full] [--quick]
       python benchmarks/lookup_host_layout_study.py --decide R.json  (prints split / packed)
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import bench_model_lookup as bench  # noqa: E402
import vllm_engram_ref  # noqa: E402
from engram_ray.tables.backends.host_memory import allocate_host_table, huge_page_bytes  # noqa: E402
from engram_ray.kernels.lookup_launch import LookupLauncher, page_rows  # noqa: E402
from engram_ray.kernels.lookup_order import FUSE_AT  # noqa: E402
from engram_ray.kernels.lookup_policy import choose_block_rows, tile_config  # noqa: E402
from lookup_timing import GIB, HEAD_DIM, NUM_COLS, ROW_BYTES, fill_random, stats  # noqa: E402
from lookup_timing import time_launches  # noqa: E402

TOKENS = [2731, 10923, 43691, 65536]  # 65K, 262K, 1M, 1.57M rows
UNSORTED_MAX_TOKENS = 10923
ROUNDS = 3
CHUNK = 1 << 22


def host_launch(rows: int) -> dict:
    """The small-page host policy's launch for `rows` as explicit options (so a huge-page
    table is read with the same launch)."""
    block_rows = choose_block_rows(rows, ROW_BYTES, "host")
    config = tile_config("host", block_rows)
    return dict(block_rows=block_rows, programs_per_sm=config.programs_per_sm,
                num_warps=config.num_warps, prefetch=config.prefetch)


class Tables:
    """Every table of the study, filled from one random packed table on the GPU."""

    def __init__(self, gib: int, kernel, num_sms: int, thp: bool = True):
        start = time.perf_counter()
        rows = gib * GIB // ROW_BYTES
        per_page, stride = page_rows(ROW_BYTES)
        rows -= rows % per_page
        packed = torch.empty(rows, ROW_BYTES, dtype=torch.uint8, device="cuda:0")
        fill_random(packed, seed=1)
        bench.avoid_zero_scales(packed)
        self.num_rows = rows
        self.timings = {}
        self.dense = self._packed_copy(packed, use_thp=False)
        self._lap("dense", start)
        self.vllm = vllm_engram_ref.VllmTable(kernel, [packed], HEAD_DIM, "host", num_sms)
        self._lap("vllm", start)
        self.thp_share = {}
        if thp:
            self.dense_thp = self._packed_copy(packed, use_thp=True)
            self._lap("dense_thp", start)
            values, scales = bench.split_host_copy(packed, use_thp=True)
            self.vllm_thp = vllm_engram_ref.VllmTable.__new__(vllm_engram_ref.VllmTable)
            self.vllm_thp.__dict__.update(self.vllm.__dict__, weight=values.view(
                torch.float8_e4m3fn), scales=scales)
            self._lap("split_thp", start)
            self.thp_share = {name: huge_page_bytes(t) / t.nbytes
                              for name, t in (("dense_thp", self.dense_thp),
                                              ("split_thp", values))}
        pages = rows // per_page
        self.pages = allocate_host_table(pages * 4096).view(pages, 4096)
        staging = torch.zeros(CHUNK // per_page, 4096, dtype=torch.uint8, device="cuda:0")
        for first in range(0, pages, staging.shape[0]):
            count = min(staging.shape[0], pages - first)
            slots = staging[:count, :per_page * stride].view(count, per_page, stride)
            slots.copy_(
                packed[first * per_page:(first + count) * per_page].view(count, per_page,
                                                                          ROW_BYTES))
            self.pages[first:first + count].copy_(staging[:count])
        self._lap("pages", start)
        del packed, staging
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    def _lap(self, name, start):
        torch.cuda.synchronize()
        self.timings[name] = round(time.perf_counter() - start, 1)
        print(f"table {name} ready at {self.timings[name]} s", flush=True)

    @staticmethod
    def _packed_copy(packed, use_thp):
        table = allocate_host_table(packed.numel(), use_thp=use_thp).view(-1, ROW_BYTES)
        for first in range(0, packed.shape[0], CHUNK):
            table[first:first + CHUNK].copy_(packed[first:first + CHUNK])
        return table

    def id_sets(self, tokens: int, seed: int) -> list[torch.Tensor]:
        gen = torch.Generator(device="cuda:0").manual_seed(seed)
        return [torch.randint(0, self.num_rows, (tokens, 2, NUM_COLS), generator=gen,
                              device="cuda:0", dtype=torch.int32)[:, 1]
                for _ in range(bench.num_id_sets(tokens * NUM_COLS))]


VGRID = dict(block_rows=16, programs_per_sm=1, num_warps=2, prefetch=True)  # vLLM's grid


def variants(t: Tables, rows: int, full: bool) -> dict:
    same = host_launch(rows)
    split = dict(table=t.vllm.weight, scales=t.vllm.scales)
    fns = {
        "vllm_sorted": lambda h, o: t.vllm.lookup(h, o, sort=True),
        "vllm_sorted_again": lambda h, o: t.vllm.lookup(h, o, sort=True),
        "dense": LookupLauncher(head_dim=HEAD_DIM, table=t.dense),
        "dense_vgrid": LookupLauncher(head_dim=HEAD_DIM, table=t.dense, **VGRID),
        "split": LookupLauncher(head_dim=HEAD_DIM, **split),
        "split_vgrid": LookupLauncher(head_dim=HEAD_DIM, **split, **VGRID),
        "pages": LookupLauncher(head_dim=HEAD_DIM, table=t.pages, layout="pages"),
    }
    if not full:
        return fns
    split_thp = dict(table=t.vllm_thp.weight, scales=t.vllm_thp.scales)
    fns.update({
        "vllm_sorted_thp": lambda h, o: t.vllm_thp.lookup(h, o, sort=True),
        "dense_thp": LookupLauncher(head_dim=HEAD_DIM, table=t.dense_thp, **same),
        "dense_sort": LookupLauncher(head_dim=HEAD_DIM, table=t.dense, order="sort"),
        "split_thp": LookupLauncher(head_dim=HEAD_DIM, **split_thp, **same),
        "split_sort": LookupLauncher(head_dim=HEAD_DIM, **split, order="sort"),
    })
    if rows <= UNSORTED_MAX_TOKENS * NUM_COLS:
        unsorted = dict(same, sort_rows=False)
        fns.update(
            vllm_unsorted=t.vllm.lookup, vllm_unsorted_thp=t.vllm_thp.lookup,
            dense_unsorted=LookupLauncher(head_dim=HEAD_DIM, table=t.dense, **unsorted),
            dense_thp_unsorted=LookupLauncher(head_dim=HEAD_DIM, table=t.dense_thp,
                                              **unsorted),
            split_unsorted=LookupLauncher(head_dim=HEAD_DIM, **split, **unsorted),
            split_thp_unsorted=LookupLauncher(head_dim=HEAD_DIM, **split_thp, **unsorted))
    return fns


def bitwise(t: Tables, fns: dict, tokens: int, out_kind: str) -> dict:
    """Each variant's output (first call and FUSE_AT calls later) against vLLM's sorted
    launch's, on ids with -1 entries."""
    ids = t.id_sets(tokens, seed=99)[0]
    flat = ids.reshape(-1).clone()
    flat[::97] = -1
    ids.copy_(flat.view(tokens, NUM_COLS))
    found, first = {}, None
    for name, fn in fns.items():
        out = torch.empty(tokens, NUM_COLS, bench.WIDTH[out_kind], dtype=bench.DTYPE[out_kind],
                          device="cuda:0")
        equal = True
        for _ in range(FUSE_AT + 1):
            out.view(torch.uint8).fill_(0xA5)
            fn(ids, out)
            torch.cuda.synchronize()
            if first is None:
                first = out.view(torch.uint8).clone()
            equal &= torch.equal(first, out.view(torch.uint8))
        found[name] = bool(equal)
    return found


def gpu_ms(fns, id_sets, out, budget_s) -> dict:
    for fn in fns.values():
        for _ in range(FUSE_AT):
            for hashes in id_sets:
                fn(hashes, out)
    samples = {name: [] for name in fns}
    for _ in range(ROUNDS):
        for name, fn in fns.items():
            samples[name] += time_launches(lambda i: fn(id_sets[i % len(id_sets)], out),
                                           budget_s=budget_s / ROUNDS)
    return {name: stats(times)["median_ms"] for name, times in samples.items()}


def run(args) -> dict:
    torch.cuda.set_device(0)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as mode:
        thp_mode = mode.read().strip()
    tables = Tables(args.host_gib, vllm_engram_ref.load_kernel(), num_sms, thp=args.full)
    print(f"THP mode {thp_mode}; huge-page share {tables.thp_share}", flush=True)
    rows_found = []
    tokens_list = TOKENS[-2:] if args.quick else TOKENS
    for out_kind in ("packed", "bf16"):
        for tokens in tokens_list:
            fns = variants(tables, tokens * NUM_COLS, args.full)
            id_sets = tables.id_sets(tokens, seed=tokens)
            out = torch.empty(tokens, NUM_COLS, bench.WIDTH[out_kind],
                              dtype=bench.DTYPE[out_kind], device="cuda:0")
            for name in list(fns):  # a variant that fails is reported and left out
                try:
                    fns[name](id_sets[0], out)
                    torch.cuda.synchronize()
                except Exception as exc:  # noqa: BLE001
                    print(f"variant {name} failed: {exc!r}", flush=True)
                    del fns[name]
            row = dict(rows=tokens * NUM_COLS, out=out_kind,
                       bitwise_equal_vllm=bitwise(tables, fns, tokens, out_kind),
                       gpu_ms=gpu_ms(fns, id_sets, out, args.budget_s))
            rows_found.append(row)
            print(json.dumps(row), flush=True)
            result = dict(rows=rows_found, device=torch.cuda.get_device_name(0),
                          commit=args.commit, date=datetime.datetime.now(
                              datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                          torch=torch.__version__, host_gib=args.host_gib, thp_mode=thp_mode,
                          thp_share=tables.thp_share, table_seconds=tables.timings)
            Path(args.json).write_text(json.dumps(result, indent=1))  # so far (a time limit)
    return result


def markdown(result: dict) -> str:
    lines = [f"# Pinned host tables: page size and layout vs vLLM 0.33's sorted launch "
             f"({result['device']})", "",
             f"{result['date']}, commit {result['commit']}, torch {result['torch']}; "
             f"{result['host_gib']} GiB tables; THP mode `{result['thp_mode']}`, huge-page "
             f"share of the THP tables {result['thp_share']}. GPU ms (device events, launches "
             "queued, L2 flushed, medians of 3 rounds taking turns); `x` = vllm_sorted / "
             "variant; bitwise = equal to vLLM's sorted launch's output.", ""]
    for r in result["rows"]:
        base = r["gpu_ms"]["vllm_sorted"]
        lines += [f"## {r['rows']:,} rows, {r['out']}", "", "| variant | GPU ms | x | bitwise |",
                  "| --- | ---: | ---: | --- |"]
        for name, ms in r["gpu_ms"].items():
            lines.append(f"| {name} | {ms:.4f} | {base / ms:.3f} | "
                         f"{r['bitwise_equal_vllm'].get(name)} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def decide(result: dict) -> str:
    """The host table layout a run supports: "split" where every (rows, out) was bitwise equal
    and the split table was faster than packed rows at every size from 1M rows and at most 2%
    slower below; else "packed"."""
    for row in result["rows"]:
        ms = row["gpu_ms"]
        if "split" not in ms or not all(row["bitwise_equal_vllm"].values()):
            return "packed"
        if ms["split"] > (1.0 if row["rows"] >= 1 << 20 else 1.02) * ms["dense"]:
            return "packed"
    return "split"


def main() -> None:
    if sys.argv[1:2] == ["--decide"]:  # gpu_model_lookup.sh: the verdict of a finished run
        try:
            print(decide(json.loads(Path(sys.argv[2]).read_text())))
        except (OSError, ValueError, KeyError, IndexError):
            from engram_ray.kernels.lookup_policy import HOST_TABLE_LAYOUT
            print(HOST_TABLE_LAYOUT)  # no study result: the policy's layout
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--md", required=True)
    parser.add_argument("--host-gib", type=int, default=8)
    parser.add_argument("--budget-s", type=float, default=0.15)
    parser.add_argument("--quick", action="store_true", help="1M and 1.57M rows only")
    parser.add_argument("--full", action="store_true", help="also huge-page tables, "
                        "ordering by row and unsorted launches (the df6c8be run)")
    parser.add_argument("--commit", default="unknown")
    args = parser.parse_args()
    result = run(args)
    Path(args.json).write_text(json.dumps(result, indent=1))
    Path(args.md).write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
