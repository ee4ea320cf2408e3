"""`rlscale bench ckpt` on CPU: every engine runs, the JSON has the issue's shape, targets are computed."""

import json

from rlscale.bench.ckpt import run_benchmark


def test_small_cpu_run_writes_the_documented_json(tmp_path):
    out_file = tmp_path / "ckpt.json"
    out = run_benchmark(tmp_path / "dir", out_file, size_gb=0.06, model=None, device_name="cpu", writers=2,
                        echo=lambda *_: None)
    saved = json.loads(out_file.read_text())
    assert saved["bytes"] == out["bytes"] > 0.03e9
    assert set(saved["limits"]) >= {"d2h_GBps", "write_GBps", "read_GBps"}
    for engine, keys in {"torch_save": {"stall_s", "durable_s"}, "dcp": {"stall_s", "durable_s", "load_s"},
                         "dcp_async": {"stall_s", "durable_s"}, "rlscale": {"stall_s", "durable_s", "load_s"}}.items():
        assert keys <= set(saved["results"][engine]), engine
        assert all(saved["results"][engine][k] > 0 for k in keys), engine
    rl = saved["results"]["rlscale"]
    assert rl["stall_s"] <= rl["durable_s"]
    assert rl["bytes_written"] >= saved["bytes"]
    # the profile of a warm save names the snapshot that the stall is made of
    assert any("checkpoint_snapshot" in line for line in rl["save_profile"])
    assert set(saved["targets"]) >= {"stall_vs_dcp_async", "durable_vs_dcp", "load_vs_read_bound"}
