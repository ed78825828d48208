"""Engram tables as an engine holds them: a whole table or one slice of a peer group
(`table`), the lookup call the model makes (`lookup`), the store rendezvous (`rendezvous`),
slice filling (`fill`), local process groups for tests and benchmarks (`local_group`) and the
memory backends (`backends`)."""
