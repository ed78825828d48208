"""engram-ray: DeepSeek-V4.1 Engram tables split across the GPUs of an NVLink domain, on Ray.

Parallel contributors: read /work/main/.tmp/HELPER_RULES.md first (shared-tree rules).
"""

__version__ = "0.1.0"
