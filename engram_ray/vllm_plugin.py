"""vLLM general plugin (entry point group `vllm.general_plugins`).

Placeholder until the vLLM integration lands: registering nothing is safe in every vLLM process.
"""


def register() -> None:
    return None
