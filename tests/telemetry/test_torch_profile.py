import json

import torch

from rlscale.telemetry.torch_profile import CALL_VARIABLE, DIR_VARIABLE, TORCH_VARIABLE, CallProfiler


def test_profiles_only_the_chosen_call(tmp_path, monkeypatch):
    monkeypatch.setenv(DIR_VARIABLE, str(tmp_path))
    monkeypatch.setenv(CALL_VARIABLE, "2")
    profiler = CallProfiler(rank=1)
    x = torch.randn(32, 32)
    for _ in range(3):
        with profiler.around("train"):
            (x @ x).sum()
            profiler.mark("matmul")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank1-train-call2.json", "rank1-train-call2.txt"]
    sections = json.loads((tmp_path / "rank1-train-call2.json").read_text())["sections_ms"]
    assert [name for name, _ in sections] == ["matmul", "end"] and all(ms >= 0 for _, ms in sections)
    text = (tmp_path / "rank1-train-call2.txt").read_text()
    assert "by CPU time" in text and "aten::mm" in text
    sections = text.split("\n\n")[0].splitlines()
    assert sections[0].startswith("## sections") and [line.split()[0] for line in sections[1:]] == ["matmul", "end"]


def test_off_without_the_directory(tmp_path, monkeypatch):
    monkeypatch.delenv(DIR_VARIABLE, raising=False)
    monkeypatch.setenv(CALL_VARIABLE, "1")
    profiler = CallProfiler(rank=0)
    with profiler.around("generate"):
        torch.ones(2).sum()
    assert profiler.calls == {"generate": 1}
    assert list(tmp_path.iterdir()) == []


def test_sections_only_without_the_torch_profiler(tmp_path, monkeypatch):
    monkeypatch.setenv(DIR_VARIABLE, str(tmp_path))
    monkeypatch.setenv(CALL_VARIABLE, "1")
    monkeypatch.setenv(TORCH_VARIABLE, "0")
    profiler = CallProfiler(rank=0)
    with profiler.around("generate"):
        profiler.mark("first")
    text = (tmp_path / "rank0-generate-call1.txt").read_text()
    assert text.startswith("## sections") and "first" in text and "aten::" not in text
