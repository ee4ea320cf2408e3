"""`rlscale bench ckpt --ranks 2` on CPU: two real gloo FSDP2 ranks of a tiny Qwen2 save and load
the sharded layout and DCP. Each rank writes and reads about half the state, every load comes
back bit-exact, and the JSON has every method's figures, per rank and aggregated."""

import json

import pytest
import torch
from transformers import Qwen2Config

from rlscale.bench.ckpt_ranks import digest, run_ranked_benchmark

TINY = Qwen2Config(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=2048, tie_word_embeddings=True, max_position_embeddings=256)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    base = tmp_path_factory.mktemp("ranks")
    out = run_ranked_benchmark(base / "dir", base / "ckpt.json", size_gb=0, model=None, device_name="cpu",
                               writers=2, ranks=2, echo=lambda *_: None, config=TINY)
    saved = json.loads((base / "ckpt.json").read_text())
    assert not any((base / "dir").iterdir())  # every method's files were deleted once measured
    return out, saved


def test_each_rank_writes_and_reads_half_the_state(result):
    _, saved = result
    total, rl = saved["bytes"], saved["results"]["rlscale"]
    assert saved["ranks"] == 2 and len(saved["per_rank"]) == 2 and total > 5e6
    assert rl["format"] == 3  # the sharded layout, not the gathered one
    for written, read in zip(rl["bytes_written_per_rank"], rl["bytes_read_per_rank"]):
        assert abs(written - total / 2) <= 0.02 * total / 2, rl["bytes_written_per_rank"]
        assert abs(read - total / 2) <= 0.02 * total / 2, rl["bytes_read_per_rank"]
    # every row read once; only AdamW's step counters (a few bytes each, held whole by every rank) twice
    assert total <= sum(r["rlscale"]["bytes_read"] for r in saved["per_rank"]) <= total * 1.001
    assert sum(r["rlscale"]["shard_file_bytes"] for r in saved["per_rank"]) >= total
    assert rl["max_share_deviation_written"] <= 0.02 and rl["max_share_deviation_read"] <= 0.02
    for rank in saved["per_rank"]:  # the engine's count and the kernel's agree
        assert rank["rlscale"]["wchar"] >= rank["rlscale"]["bytes_written"]
        assert rank["local_state_bytes"] <= 0.6 * total


def test_the_loads_are_bit_exact(result):
    _, saved = result
    for rank in saved["per_rank"]:
        for method in ("rlscale", "dcp"):
            row = rank[method]
            assert row["overwrite_changed_state"], method  # the check is not vacuous
            assert row["bit_exact"] and row["mismatches"] == [], (method, row["mismatches"])
    assert saved["results"]["rlscale"]["bit_exact"] and saved["results"]["dcp"]["bit_exact"]


def test_the_json_has_every_method_and_bound(result):
    out, saved = result
    assert saved["bytes"] == out["bytes"]
    assert {"date", "device", "code", "model", "params", "limits", "bounds_s", "targets"} <= set(saved)
    assert set(saved["limits"]) >= {"d2h_GBps", "write_GBps", "read_GBps"}
    for method, keys in {"dcp": {"stall_s", "durable_s", "load_s"}, "dcp_async": {"stall_s", "durable_s"},
                         "rlscale": {"stall_s", "durable_s", "load_s"}}.items():
        assert all(saved["results"][method][k] > 0 for k in keys), method
        for rank in saved["per_rank"]:
            assert all(rank[method][k] > 0 for k in keys & set(rank[method]) - {"durable_s"}), (method, rank["rank"])
    rl = saved["results"]["rlscale"]
    assert rl["stall_s"] <= rl["durable_s"]
    assert all(r["dcp"]["wchar"] > 0.4 * saved["bytes"] for r in saved["per_rank"])
    assert set(saved["targets"]) >= {"stall_vs_copy_bound", "durable_vs_dcp", "load_vs_read_bound",
                                     "bytes_written_per_rank_vs_share", "bytes_read_per_rank_vs_share"}


def test_the_digest_sees_one_flipped_bit_and_a_swap():
    t = torch.randn(1000)
    flipped = t.clone()
    flipped.view(torch.int32)[517] ^= 1 << 20
    swapped = t.clone()
    swapped[[3, 4]] = t[[4, 3]]
    assert digest(t) == digest(t.clone())
    assert digest(flipped) != digest(t) and digest(swapped) != digest(t)
    assert digest(torch.tensor(3.0)) != digest(torch.tensor(7.0))
