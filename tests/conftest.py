"""Shared test set-up: GPU markers skip what the machine cannot run."""

import pytest


def _cuda_device_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config, items):
    num_gpus = _cuda_device_count()
    for item in items:
        if "gpu" in item.keywords and num_gpus == 0:
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))
        if "multi_gpu" in item.keywords and num_gpus < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs 2 CUDA devices, found {num_gpus}"))
