"""Peer memory of peer-group tables: backends behind one interface (`base.PeerMemory`):
`shm` (CPU, shared-memory files) and `cuda` (CUDA VMM slices, FABRIC or POSIX-FD handles);
the handle type a group's slices travel as (`handle_types`), slice filling (`fill`), fd passing
(`pidfd`), the driver and its probes (`cuda_driver`), and local process groups for tests and
benchmarks (`local_group`)."""
