"""Memory backends of peer-group tables, behind one interface (`base.PeerMemory`): `shm`
(CPU, shared-memory files) and `cuda` (CUDA VMM slices, FABRIC or POSIX-FD handles); the handle
type a group's slices travel as (`handle_types`), fd passing (`pidfd`), the driver and its
probes (`cuda_driver`) and pinned host memory (`host_memory`)."""
