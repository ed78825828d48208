"""Peer slices handed over through the members' slice holders (SCM_RIGHTS over a Unix socket in
the 0700 store folder), not taken from another process with pidfd_getfd: a group of two on one
GPU meets through the real rendezvous (cuda backend, POSIX-FD handles), each member maps the
other's slice from the holder its engine process runs for the rendezvous and looks up rows of
the whole table bitwise equal to the torch reference through a read-only mapping of the
other's slice; no holder socket is left afterwards.
"""

import pytest
import torch

from engram_ray.model.layout import EngramLayout
from engram_ray.tables.local_group import check_member, run_group

# ~20K-row buckets: ~0.49M rows per table (122 MiB)
SMALL = EngramLayout(layer_ids=(1, 14), vocab_size=20_000, max_ngram_size=4, n_heads=8,
                     head_dim=256, compressed_vocab_size=1000, pad_token_id=2)


class _OwnIdentity:
    """A GPU's properties with a uuid of this member's own."""

    def __init__(self, props, rank: int):
        self._props, self.uuid = props, f"{props.uuid}-member{rank}"

    def __getattr__(self, name):
        return getattr(self._props, name)


def member_sharing_the_gpu(rank, layout, size, store_dir, generation):
    """check_member on GPU 0 for every rank. A group refuses two members on one GPU (a
    misplaced engine would hold two slices there); this test shares the one GPU it may have on
    purpose, so each member reports a GPU identity of its own. Everything else is real."""
    real = torch.cuda.get_device_properties
    torch.cuda.get_device_properties = lambda device=None: _OwnIdentity(real(device), rank)
    return check_member(rank, layout, size, store_dir, generation, "cuda", "cuda", seed=3,
                        num_tokens=64, timeout_s=60, handle_type="posix_fd")


@pytest.mark.gpu
def test_two_members_map_each_others_slices_from_their_holders(tmp_path):
    store = tmp_path / "store"
    results = run_group(member_sharing_the_gpu, [0, 1], (SMALL, 2, str(store), "exchange-2"),
                        timeout_s=240, start_method="spawn")
    for result in results:
        assert result.is_ok, result.value
        assert all(result.value["equal"].values()), (result.rank, result.value["equal"])
        assert result.value["stats"]["handle_type"] == "posix_fd"
        assert result.value["stats"]["rendezvous_seconds"] > 0
        # The other member's slice is mapped read-only for this GPU (cuMemSetAccess
        # PROT_READ), and every row read through it was bitwise right.
        assert result.value["stats"]["peer_access"] == "read", result.value["stats"]
    assert not list(store.glob("holder-*.sock"))  # each member's holder closed with the meeting
