"""The vLLM side: the plugin every vLLM process loads (`plugin`), the patched DeepSeek-V4.1
Engram lookup (`deepseek_engram`), the vLLM releases it supports and what it assumes about
their source (`compat`, `assumptions`), the tables a model holds (`engram_tables`; peer-group
settings come from `additional_config` through `engram_ray.tables.settings`), the engine
arguments an architecture needs (`engine_settings`), the CPU features vLLM's CPU backend needs
(`cpu_features`) and the tiny Engram model (`tiny_engram`, `tiny_checkpoint`, `tiny_tokenizer`,
`ngram_history`).

Nothing here imports `engram_ray.serve` or `engram_ray.local`.
"""
