"""Pure parts: which steps retention deletes, the safetensors layout, the byte-balanced split."""

import pytest
import torch

from rlscale.ckpt import tensorfile
from rlscale.ckpt.retention import steps_to_delete
from rlscale.workers.state_io import split_by_bytes


def test_newest_is_kept_even_when_it_ranks_worst():
    steps = [(1, {"acc": 0.9}), (2, {"acc": 0.8}), (3, {"acc": 0.1})]
    assert steps_to_delete(steps, 1, "acc", higher_is_better=True) == [2]
    assert steps_to_delete(steps, 2, "acc", higher_is_better=True) == []


def test_top_k_by_metric_in_either_direction_and_missing_metrics_rank_last():
    steps = [(1, {"loss": 0.5}), (2, {"loss": 0.2}), (3, {}), (4, {"loss": 0.9}), (5, {"loss": 0.4})]
    assert steps_to_delete(steps, 2, "loss", higher_is_better=False) == [1, 3, 4]
    assert steps_to_delete(steps, 2, "loss", higher_is_better=True) == [2, 3]
    assert steps_to_delete(steps, 2, None) == [1, 2, 3]  # recency
    assert steps_to_delete(steps, None, "loss") == []


def test_files_we_write_are_ordinary_safetensors():
    tensors = {"w": torch.randn(3, 5), "h": torch.randn(7).to(torch.bfloat16), "step": torch.tensor(4.0),
               "ids": torch.arange(6), "mask": torch.tensor([True, False])}
    plan = tensorfile.plan_file([(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()], {"format": "pt"})
    buffer = tensorfile.host_buffer(plan.size, pinned=False)
    tensorfile.fill(buffer, plan, tensors)
    assert all(s.start % s.dtype.itemsize == 0 for s in plan.slots)  # views need aligned starts
    raw = bytes(buffer.numpy())
    from safetensors.torch import load

    back = load(raw)
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], v) for k, v in tensors.items())
    parsed = tensorfile.parse_header(raw, len(raw))
    viewed = tensorfile.views(buffer, parsed)
    assert all(torch.equal(viewed[k], v) and viewed[k].shape == v.shape for k, v in tensors.items())


def test_parse_header_rejects_damage():
    plan = tensorfile.plan_file([("a", torch.float32, (4,))])
    raw = plan.header + bytes(16)
    with pytest.raises(ValueError, match="data ends"):
        tensorfile.parse_header(raw, len(raw) + 1)
    with pytest.raises(ValueError, match="runs past"):
        tensorfile.parse_header(raw[:12], 12)
    with pytest.raises(ValueError, match="JSON"):
        tensorfile.parse_header(raw[:8] + b"x" + raw[9:], len(raw))


def test_write_then_read_round_trips_with_checksum(tmp_path):
    data = torch.randint(0, 255, (1000,), dtype=torch.uint8)
    path = str(tmp_path / "x.bin")
    size, digest = tensorfile.write_file(path, data)
    buffer, read_digest = tensorfile.read_file(path, size, checksum=True)
    assert size == 1000 and torch.equal(buffer, data) and read_digest == digest == tensorfile.file_checksum(path)


def test_split_by_bytes_is_contiguous_balanced_and_complete():
    sizes = [10, 10, 10, 10, 40, 10, 10]
    parts = split_by_bytes(sizes, 3)
    assert [i for r in parts for i in r] == list(range(7))
    assert [sum(sizes[i] for i in r) for r in parts] == [30, 50, 20]
    assert split_by_bytes([5], 3) == [range(0, 0), range(0, 1), range(1, 1)]  # empty shares are allowed
    assert split_by_bytes([], 2) == [range(0, 0), range(0, 0)]
