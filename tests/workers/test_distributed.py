import torch

from rlscale.workers.distributed import shard_reference


def test_reference_sharding_follows_the_setting_and_stays_whole_off_gpu():
    model = torch.nn.Linear(4, 4)
    assert shard_reference(True, model, torch.device("cpu")) is True
    assert shard_reference(False, model, torch.device("cpu")) is False
    assert shard_reference(None, model, torch.device("cpu")) is False  # gloo: a whole copy, no all-gathers
