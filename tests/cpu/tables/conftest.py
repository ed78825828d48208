"""Fixtures of the table tests."""

import pytest


@pytest.fixture
def shm_dir(tmp_path, monkeypatch):
    """A private folder for the shm backend's slice files (ENGRAM_RAY_SHM_DIR)."""
    path = tmp_path / "shm"
    path.mkdir()
    monkeypatch.setenv("ENGRAM_RAY_SHM_DIR", str(path))
    return path
