"""engram-ray: DeepSeek-V4.1 Engram tables split across the GPUs of an NVLink domain, on Ray.
"""

__version__ = "0.1.0"
