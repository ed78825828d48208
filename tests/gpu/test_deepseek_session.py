"""The DeepSeek-V4.1 patch's peer-group session on real GPUs (cuda backend), without vLLM
(the lent GPU machines have none): each member allocates its slices, writes its own rows the
way vLLM's loader does (checkpoint narrowed from the slice's first row into strided views of
the packed slice), joins after the last table is loaded, and looks up rows of the whole table
through engram-ray's kernel, bitwise equal to the torch reference.

Passed on 2 x H200 (2026-11-30, 17 s). Run it from outside the checkout
(`cd /tmp && python -m pytest /path/to/tests/gpu/test_deepseek_session.py`) after
`pip install --no-deps --no-build-isolation -e .`: spawned members started in the checkout
import the source `engram_ray/` folder, which has no `kernels` subpackage.
"""

import uuid

import pytest
import torch

from engram_ray.model.layout import EngramLayout
from engram_ray.tables.local_group import run_group

SMALL = EngramLayout(layer_ids=(1, 14), vocab_size=20_000, max_ngram_size=4, n_heads=8,
                     head_dim=256, compressed_vocab_size=1000, pad_token_id=2)


def _checkpoint_table(layer_idx, layout):
    from engram_ray.model.reference import random_table
    gen = torch.Generator().manual_seed(100 + layer_idx)
    return random_table(layout.rows_per_table[layer_idx], layout.head_dim, generator=gen)


def session_member(rank, layout, size, store_dir, generation):
    from engram_ray.model.reference import lookup_reference
    from engram_ray.tables.settings import PeerGroupSettings
    from engram_ray.tables.table import EngramTables

    torch.cuda.set_device(rank)
    settings = PeerGroupSettings(size=size, store_dir=store_dir, rank=rank, generation=generation,
                                 backend="cuda", timeout_s=60)
    session = EngramTables.member(layout, settings, f"cuda:{rank}")
    dim, full = layout.head_dim, {}
    for layer_idx, layer_id in enumerate(layout.layer_ids):
        table = session.add_table(session.layer_of(layout.rows_per_table[layer_idx],
                                                   layout.primes[layer_idx]))
        assert table.layer_id == layer_id
        full[layer_id] = _checkpoint_table(layer_idx, layout)
        owned = table.local[:table.num_owned_rows]
        start, rows = table.slice_start, table.num_owned_rows
        owned[:, :dim].view(torch.float8_e4m3fn).copy_(
            full[layer_id][:, :dim].view(torch.float8_e4m3fn).narrow(0, start, rows))
        owned[:, dim:].copy_(full[layer_id][:, dim:].narrow(0, start, rows))
    for layer_id in layout.layer_ids:
        assert not session.is_joined
        session.mark_loaded(layer_id)
    equal = {}
    gen = torch.Generator().manual_seed(rank)
    for layer_idx, layer_id in enumerate(layout.layer_ids):
        ids = torch.randint(-1, layout.rows_per_table[layer_idx], (1000, layout.num_cols),
                            generator=gen)
        for out in ("bf16", "packed"):
            got = session.lookup(layer_id, ids.cuda().to(torch.int32), out)
            expected = lookup_reference(full[layer_id], ids, dim, out)
            equal[f"{layer_id}/{out}"] = torch.equal(got.cpu(), expected)
    stats = session.stats()
    session.close()
    return {"equal": equal, "stats": stats}


@pytest.mark.gpu
@pytest.mark.multi_gpu
def test_deepseek_session_on_two_gpus(tmp_path):
    results = run_group(session_member, [0, 1],
                        (SMALL, 2, str(tmp_path / "store"), uuid.uuid4().hex[:12]),
                        timeout_s=240, start_method="spawn")
    for result in results:
        assert result.is_ok, result.value
        assert all(result.value["equal"].values()), (result.rank, result.value["equal"])
        slices = [t["slice"] for t in result.value["stats"]["tables"]]
        rows = SMALL.rows_per_table
        per_rank = [-(-r // 2) for r in rows]
        assert slices == [[result.rank * p, min(r, (result.rank + 1) * p)]
                          for r, p in zip(rows, per_rank)]
