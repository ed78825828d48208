"""Triton kernels, one op per file (installed as `engram_ray.kernels`): `lookup` gathers Engram
rows from HBM, host or peer-group tables; `lookup_policy` picks its tile size."""
