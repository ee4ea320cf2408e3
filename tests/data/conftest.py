import json

import pytest


@pytest.fixture
def offline_hf(monkeypatch, tmp_path):
    """No network and a private cache: hub ids fail fast, local folders load for real.

    datasets / huggingface_hub read these variables at import time, so the module constants are
    patched as well as the environment.
    """
    import datasets
    import huggingface_hub.constants

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


@pytest.fixture
def write_jsonl():
    """write_jsonl(path, rows) -> path; a fixture so test modules need not import conftest."""

    def write(path, rows):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path

    return write
