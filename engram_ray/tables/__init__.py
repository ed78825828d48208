"""Engram tables as an engine holds them: a whole table or one slice of a peer group
(`table`), the lookup call the model makes (`lookup`), the store rendezvous (`rendezvous`),
slice filling (`fill`), local process groups for tests and benchmarks (`local_group`) and the
memory backends (`backends`)."""

# The one list of table backends (name -> the PeerMemory class behind it, imported when used)
# and of fills; the deployment config, vLLM's additional_config and the tables all check
# against these.
BACKENDS = {"shm": "engram_ray.tables.backends.shm:ShmPeerMemory",
            "cuda": "engram_ray.tables.backends.cuda:CudaPeerMemory"}
FILLS = ("synthetic", "checkpoint")
