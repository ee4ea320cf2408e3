"""fp32 master weights at one worker: the bf16 compute copy (rlscale.workers.compute_copy) takes
the same optimizer steps as an FSDP2 group of one (FSDP2's MixedPrecisionPolicy, the mechanism over
several workers), with no FSDP2 hooks around the modules."""

import pytest
import torch

from rlscale.config_loading import load_config
from rlscale.workers.policy import PolicyWorker
from tests.workers.test_fsdp_update import OVERRIDES, two_steps, whole_weights

BF16_FP32_MASTER = [*OVERRIDES, "policy.dtype=bfloat16", "policy.master_weights=fp32"]


@pytest.fixture
def leave_group():
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("fsdp_keep_gathered", ["true", "false"])
def test_compute_copy_takes_the_fsdp2_group_of_ones_steps_bit_for_bit(fsdp_keep_gathered, leave_group):
    torch.set_num_threads(1)
    copy = PolicyWorker(load_config(None, BF16_FP32_MASTER))
    assert copy.compute_copy is not None and not copy.sharded
    assert all(p.dtype == torch.float32 for p in copy.model.parameters())
    fsdp = PolicyWorker(load_config(None, [*BF16_FP32_MASTER, f"policy.keep_gathered={fsdp_keep_gathered}"]),
                        distributed_group=True)
    assert fsdp.compute_copy is None and fsdp.sharded
    rows = list(range(8))  # several packed micro-batches per optimizer step (32-token budget)
    copy_weights, copy_stats = two_steps(copy, rows)
    fsdp_weights, fsdp_stats = two_steps(fsdp, rows)
    assert copy_stats["first_grad_norm"] > 0
    for name, value in copy_weights.items():
        assert value.dtype == torch.float32
        assert torch.equal(value, fsdp_weights[name]), name
    # the first step bit for bit (above); the second step's forward too (its loss and entropy), but
    # the gradient norm sums its squares in another order over DTensors: 7.602066994 vs 7.602067471
    # (torch 2.13 CPU, 2026-12-05), and the clipped update then differs by one fp32 ulp (1.5e-8)
    for key in ("first_grad_norm", "loss", "kl", "entropy"):
        assert copy_stats[key] == fsdp_stats[key], key
    assert copy_stats["grad_norm"] == pytest.approx(fsdp_stats["grad_norm"], rel=1e-6)
    after = whole_weights(fsdp)
    for name, value in whole_weights(copy).items():
        torch.testing.assert_close(value, after[name], rtol=0, atol=1e-7, msg=name)


def test_the_copy_computes_in_bf16_and_leaves_the_fp32_parameters_in_place():
    torch.set_num_threads(1)
    worker = PolicyWorker(load_config(None, BF16_FP32_MASTER))
    model = worker.model
    masters = dict(model.named_parameters())
    seen = []
    hook = model.get_decoder().layers[0].mlp.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    ids = torch.tensor([[5, 6, 7, 8]])
    with worker.computing():
        inside = dict(model.named_parameters())
        assert all(p.dtype == torch.bfloat16 for p in inside.values())
        assert all(torch.equal(inside[n], masters[n].bfloat16()) for n in masters)  # cast afresh on entry
        model(input_ids=ids).logits.float().pow(2).mean().backward()
        assert all(p.grad is None for p in inside.values())  # each bf16 gradient freed once added to its master
    hook.remove()
    assert seen == [torch.bfloat16]
    assert dict(model.named_parameters()) == masters  # the same fp32 objects back in the modules
    grads = [p.grad for p in masters.values()]
    assert all(g is not None and g.dtype == torch.float32 for g in grads)
    # an optimizer step on the masters reaches the next pass's copy
    worker.optimizer.step()
    with worker.computing():
        assert all(torch.equal(p, masters[n].bfloat16()) for n, p in model.named_parameters())
