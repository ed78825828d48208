"""The lookup as vLLM's model calls it (`engram_ray.tables.lookup.TableLookup`, what the
DeepSeek-V4.1 patch runs): int32 hashes as one layer's column slice of `[T, L, C]`, rows
written into a persistent staging buffer; bit for bit against the torch reference.

- captured in a CUDA graph and replayed on new hashes (HBM, peer slices on one GPU, pinned
  host: unsorted and, past `SORT_MIN_ROWS`, sorted);
- the direct launches of the compiled kernel (after the first JIT launch of each entry);
- lookup metrics sampled without a device sync.
"""

import pytest
import torch

from engram_ray.model.reference import lookup_reference

from lookup_support import HEAD_DIM, NUM_ROWS, ROWS_PER_RANK, assert_bitwise, poisoned, random_ids

pytestmark = pytest.mark.gpu

NUM_LAYERS, NUM_COLS = 2, 24
PLACEMENTS = ["hbm", "peer", "host"]
# 1, 1.5K, 48K (host: sorted) and 65K looked-up rows
TOKENS = [1, 64, 2000, 2731]


def _reader(placement, hbm_table, host_table, meter=None):
    from engram_ray.tables.lookup import TableLookup
    if placement == "peer":
        slices = list(hbm_table.split(ROWS_PER_RANK))
        bases = torch.tensor([piece.data_ptr() for piece in slices], device="cuda:0")
        return TableLookup(HEAD_DIM, peer_bases=bases, rows_per_rank=ROWS_PER_RANK, meter=meter)
    table = hbm_table if placement == "hbm" else host_table
    return TableLookup(HEAD_DIM, table=table, meter=meter)


def _fill_hashes(hashes, layer_idx, seed):
    """vLLM's hashes buffer `[T, L, C]` int32: layer `layer_idx` gets fresh random ids."""
    ids = random_ids((hashes.shape[0], NUM_COLS), seed)
    hashes[:, layer_idx].copy_(ids)
    hashes[:, 1 - layer_idx].fill_(NUM_ROWS + 7)  # the other layer's ids: never read here
    return ids


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("out", ["bf16", "packed"])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_graph_replay_on_new_hashes(hbm_table, host_table, placement, out, tokens):
    reader = _reader(placement, hbm_table, host_table)
    hashes = torch.empty(tokens, NUM_LAYERS, NUM_COLS, dtype=torch.int32, device="cuda:0")
    staged = poisoned((tokens, NUM_COLS), out)
    view = hashes[:, 1]
    assert not view.is_contiguous() or tokens == 1
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: compile, prepare, first direct launch
        for seed in range(3):
            ids = _fill_hashes(hashes, 1, seed)
            reader(view, staged)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    assert_bitwise(staged, lookup_reference(hbm_table, ids, HEAD_DIM, out))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        reader(view, staged)
    for seed in range(10, 13):
        ids = _fill_hashes(hashes, 1, seed)
        staged.view(torch.uint8).fill_(0xA5)
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise(staged, lookup_reference(hbm_table, ids, HEAD_DIM, out))


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_direct_launches_match_the_reference(hbm_table, host_table, placement):
    """Every entry key a model meets (ids int32/int64, contiguous/a view, both outputs, 16-byte
    aligned or not, small and large lookups): the second call of each launches the compiled
    kernel directly, and both calls are bit-exact."""
    reader = _reader(placement, hbm_table, host_table)
    cases = [(t, d, v, o, s) for t in (1, 17, 2731, 43691) for d in (torch.int32, torch.int64)
             for v in (False, True) for o in ("bf16", "packed") for s in (0, 1)]
    for seed, (tokens, dtype, is_view, out, shift) in enumerate(cases):
        num_ids = tokens * NUM_LAYERS * NUM_COLS
        hashes = torch.empty(shift + num_ids, dtype=dtype, device="cuda:0")[shift:].view(
            tokens, NUM_LAYERS, NUM_COLS)  # shift: ids start 4 or 8 bytes past 16
        flat = torch.empty(shift + tokens * NUM_COLS, dtype=dtype, device="cuda:0")
        width = poisoned((1, 1), out).shape[-1]
        rows = poisoned((shift + tokens * NUM_COLS, 1), out).view(-1, width)
        staged = rows[shift:].view(tokens, NUM_COLS, width)  # packed + shift: 8 bytes past 16
        for call in range(2):
            ids = _fill_hashes(hashes, 0, 1000 * seed + call)
            if is_view:
                given = hashes[:, 0]
            else:
                given = flat[shift:].view(tokens, NUM_COLS)
                given.copy_(ids)
            staged.view(torch.uint8).fill_(0xA5)
            assert reader(given, staged) is staged
            torch.cuda.synchronize()
            assert_bitwise(staged, lookup_reference(hbm_table, ids, HEAD_DIM, out))
    launches = reader._read._launches
    assert launches and all(launch.direct is not None for launch in launches.values())


def test_metered_lookups_do_not_wait_for_the_gpu(hbm_table, host_table, monkeypatch):
    """A sampled lookup records events and device-side counts: the host returns while the GPU
    is still busy; the samples are published once their events completed (scrape / drain)."""
    from engram_ray.metrics.engine import EngineIdentity, EngineMetrics
    from engram_ray.metrics.lookup_meter import LookupMeter

    metrics = EngineMetrics(EngineIdentity("m", "e", "g", 0))
    meter = LookupMeter(metrics, 1, ROWS_PER_RANK, rank=0, gpu_sample_every=2)
    reader = _reader("peer", hbm_table, host_table, meter=meter)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("synchronized"))
    hashes = torch.empty(4096, NUM_LAYERS, NUM_COLS, dtype=torch.int32, device="cuda:0")
    ids = _fill_hashes(hashes, 0, 7)
    staged = poisoned((4096, NUM_COLS), "bf16")
    for _ in range(4):
        reader(hashes[:, 0], staged)  # warm-up; samples 2 and 4 are metered
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU work queued ahead
    busy = torch.cuda.Event()
    reader(hashes[:, 0], staged)
    reader(hashes[:, 0], staged)  # sampled
    busy.record()
    assert not busy.query(), "the metered lookup waited for the GPU"
    monkeypatch.undo()
    torch.cuda.synchronize()
    meter.drain()
    metrics.registry.collect()
    samples = metrics.lookup_seconds.collect()[0].samples
    count = sum(s.value for s in samples if s.name.endswith("_count"))
    assert count == 3
    valid = int((ids >= 0).sum())
    local = int(((ids >= 0) & (ids < ROWS_PER_RANK)).sum())
    rows = {s.labels["rows"]: s.value for s in metrics.rows_total.collect()[0].samples
            if s.name.endswith("_total")}
    assert rows == {"local": 3 * local, "remote": 3 * (valid - local)}


def test_sorted_host_lookups_order_ids_through_replayed_graphs(hbm_table, host_table):
    """Sorted host lookups (kernels/lookup_order.py): sizes shrinking inside one padded bucket
    (the pads of a larger call must not leak into a smaller one), a larger bucket, int64 ids,
    and a call on another stream; each bit-exact, each size class met twice on a replayed
    graph (the first call of a bucket sorts op by op)."""
    reader = _reader("host", hbm_table, host_table)
    side = torch.cuda.Stream()
    cases = [(2000, torch.int32, None), (1400, torch.int32, None), (1900, torch.int32, None),
             (2731, torch.int32, None), (2731, torch.int32, None), (1500, torch.int64, None),
             (1500, torch.int64, None), (1700, torch.int32, side), (1400, torch.int32, None)]
    for seed, (tokens, dtype, stream) in enumerate(cases):
        hashes = torch.empty(tokens, NUM_LAYERS, NUM_COLS, dtype=dtype, device="cuda:0")
        ids = _fill_hashes(hashes, 1, 500 + seed)
        staged = poisoned((tokens, NUM_COLS), "packed")
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream or torch.cuda.current_stream()):
            reader(hashes[:, 1], staged)
        torch.cuda.synchronize()
        assert_bitwise(staged, lookup_reference(hbm_table, ids, HEAD_DIM, "packed"))
    graphs = reader._read._graph_sort._graphs
    assert set(graphs) == {(1 << 16, torch.int32), (1 << 17, torch.int32),
                           (1 << 16, torch.int64)}


@pytest.mark.parametrize("order", ["sort", "blocks"])
def test_sorted_host_lookups_replay_ordering_and_lookup_as_one_graph(hbm_table, host_table,
                                                                    order, monkeypatch):
    """Sorted host lookups at one (ids, output) address: from the FUSE_AT-th call ordering and
    lookup replay as one graph (by row and by table block), on new hashes each call, on
    another stream, at a smaller size (a graph of its own) and inside a caller's capture
    (op by op there); each bit-exact against the reference."""
    from engram_ray.kernels.lookup_launch import LookupLauncher
    from engram_ray.kernels.lookup_order import FUSE_AT
    launcher = LookupLauncher(head_dim=HEAD_DIM, order=order, table=host_table)
    hashes = torch.empty(2000, NUM_LAYERS, NUM_COLS, dtype=torch.int32, device="cuda:0")
    outs = {kind: poisoned((2000, NUM_COLS), kind) for kind in ("packed", "bf16")}
    side = torch.cuda.Stream()
    calls = [(2000, None)] * (FUSE_AT + 1) + [(2000, side), (1500, None)] * FUSE_AT
    for seed, (tokens, stream) in enumerate(calls):
        for kind, staged in outs.items():
            ids = _fill_hashes(hashes, 1, 700 + seed)[:tokens]
            staged.view(torch.uint8).fill_(0xA5)
            if stream is not None:
                stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream or torch.cuda.current_stream()):
                launcher(hashes[:tokens, 1], staged[:tokens])
            torch.cuda.synchronize()
            assert_bitwise(staged[:tokens], lookup_reference(hbm_table, ids, HEAD_DIM, kind))
    assert len(launcher._graph_sort.fused) == 4  # (2000, 1500 tokens) x (packed, bf16)
    staged = outs["packed"]
    # a call met before goes straight to its graph: no launch decisions looked up
    launcher._launches.clear()
    monkeypatch.setattr(launcher, "_prepare", lambda *a: pytest.fail("not replayed"))
    ids = _fill_hashes(hashes, 1, 800)
    staged.fill_(0xA5)
    launcher(hashes[:, 1], staged)
    torch.cuda.synchronize()
    assert_bitwise(staged, lookup_reference(hbm_table, ids, HEAD_DIM, "packed"))
    monkeypatch.undo()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launcher(hashes[:, 1], staged)
    for seed in range(3):
        ids = _fill_hashes(hashes, 1, 900 + seed)
        staged.fill_(0xA5)
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise(staged, lookup_reference(hbm_table, ids, HEAD_DIM, "packed"))
