"""Models served by vLLM with engram-ray's Engram tables.

`tiny_engram.EngramTinyForCausalLM` is a small decoder with Engram layers (the local default
model); `tiny_checkpoint` writes it (config, tokenizer, seeded weights). Registered with vLLM by
`engram_ray.vllm_plugin.register`.
"""
