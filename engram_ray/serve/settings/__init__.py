"""The Serve application's settings: the `args` of a Serve YAML parsed and checked (`config`),
two versions compared (`config_change`: what a change rolls out, and how), the vLLM engine
arguments they give (`engine_args`), and the options passed through to vLLM and Ray Serve LLM
checked against the libraries' own names (`library_options`).

Imports: nothing of `engram_ray.serve` but this room (the other rooms import it).
"""
