"""The worker side of tensor-parallel generation: ranks numbered by node, the tensor-parallel
groups, and the rollout engine's weights synced one FSDP2 unit at a time.

The two-rank tests run real gloo processes on the CPU with the shipped tiny model (4 heads, 4
layers, a vocabulary of 99 that splits into padded halves): two PolicyWorkers per process, one
generating with T=2 (the group of both ranks) and one with T=1, both synced unit by unit."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from rlscale.config_loading import load_config
from rlscale.rollout import SamplingParams
from rlscale.workers.ray_group import ranks_by_node

# ---------------------------------------------------------------------- ranks by node (no processes)


def test_ranks_by_node_make_each_nodes_ranks_consecutive_with_rank_0s_node_first():
    # Ray's placement: bundles 0 and 3 on node "b", 1 and 2 on "a", 4 on "c"
    nodes = ["b", "a", "a", "b", "c"]
    order = ranks_by_node(nodes)
    assert order[0] == 0  # rank 0 stays bundle 0: the rendezvous is on its node
    assert [nodes[b] for b in order] == ["b", "b", "a", "a", "c"]  # rank 0's node, then by node id
    assert order == [0, 3, 1, 2, 4]  # on a node, bundles keep their order
    assert sorted(order) == list(range(len(nodes)))


def test_ranks_by_node_leave_an_ordered_placement_as_it_is():
    assert ranks_by_node(["n1", "n1", "n0", "n0"]) == [0, 1, 2, 3]
    assert ranks_by_node(["n0"]) == [0] and ranks_by_node([]) == []


# ---------------------------------------------------------------------- the requests' keys (no processes)


class RecordingGroup:
    """A worker group that records each rank's generate arguments and echoes the texts back."""

    def __init__(self, world_size: int):
        self.world_size, self.calls = world_size, []

    def run_all(self, method: str, per_worker_args: list[tuple]):
        from rlscale.workers.batch import Rollouts

        assert method == "generate" and len(per_worker_args) == self.world_size
        self.calls.append(per_worker_args)
        return [Rollouts(prompt_ids=[[1]] * len(texts), response_ids=[[2]] * len(texts), texts=list(texts),
                         truncated=[False] * len(texts), logprobs=[[0.0]] * len(texts), prompt_cut=[False] * len(texts))
                for texts, *_ in per_worker_args]


def test_rollouts_and_evaluations_key_each_sample_by_its_index_in_the_whole_request():
    from rlscale.controller import generate_rollouts
    from rlscale.data import Problem
    from rlscale.evaluate import evaluate

    texts = [f"t{i}" for i in range(7)]
    group = RecordingGroup(3)
    out = generate_rollouts(group, texts, SAMPLED)
    assert out.texts == texts
    (args,) = group.calls
    assert [list(a[0]) for a in args] == [texts[0:3], texts[3:5], texts[5:7]]
    assert [a[3] for a in args] == [[0, 1, 2], [3, 4], [5, 6]]  # the shards' global sample ids
    assert all(a[1] is SAMPLED and a[2] is True for a in args)

    class Scorer:
        function = "test"

        def score(self, responses, answers):
            from types import SimpleNamespace

            return SimpleNamespace(rewards=[0.0] * len(responses), check=lambda *a: None)

    group = RecordingGroup(2)
    problems = [Problem(text=f"p{i}", answer="0") for i in range(3)]
    evaluate(group, problems, Scorer(), SAMPLED, k=2, chunk=4)  # 6 samples in chunks of 4 and 2
    assert [[a[3] for a in call] for call in group.calls] == [[[0, 1], [2, 3]], [[4], [5]]]


def test_generation_seeds_differ_by_step_purpose_and_run_seed_and_repeat():
    from rlscale.controller import generation_seed, sampling_params

    cfg = load_config(None, [])
    other = load_config(None, ["grpo.seed=7"])
    seeds = {generation_seed(cfg, step, purpose) for step in range(50) for purpose in ("rollout", "validation")}
    assert len(seeds) == 100 and all(0 <= s < 2**31 for s in seeds)
    assert generation_seed(cfg, 3) == generation_seed(load_config(None, []), 3)  # a resume draws the same
    assert generation_seed(other, 3) != generation_seed(cfg, 3)
    assert sampling_params(cfg).seed == generation_seed(cfg, 0, "evaluation")
    assert sampling_params(cfg, seed=11).seed == 11


# ---------------------------------------------------------------------- two gloo ranks

OVERRIDES = ["cluster.gpus_per_node=2", "policy.cpu_threads=1", "loss.reference_policy_kl_penalty=0",
             "policy.keep_gathered=false", "policy.fsdp_layers_per_unit=1", "policy.max_total_sequence_length=64",
             "cluster.collective_timeout_s=120", "policy.generation.max_new_tokens=12"]
TEXTS = ["12+7=", "305+96=", "8+8=", "41+120=", "7+5=", "99+1="]
SHARES = [[0, 1, 2], [3, 4, 5]]  # each rank's sample ids: its texts' indices in TEXTS
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=12, seed=2024)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, seed=2024)


def param_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def watch_weight_syncs(worker, record: list, phase: list) -> None:
    """Record, at each of the engine's copy_named calls (the streamed sync's, and the one the
    whole-model sync makes), the bytes handed over and the bytes of every parameter of the policy
    that is unsharded at that moment, tagged with phase[0]."""
    engine = worker._rollout_engine()
    copy_named = engine.weights.copy_named

    def watched(pairs):
        pairs = list(pairs)
        unsharded = [p for p in worker.model.parameters() if not hasattr(p, "to_local")]
        record.append({"phase": phase[0], "unit": param_bytes(t for _, t in pairs),
                       "unsharded": param_bytes(unsharded), "names": [name for name, _ in pairs]})
        return copy_named(pairs)

    engine.weights.copy_named = watched


def corrupt(engine) -> None:
    """Overwrite the engine's weights: a sync that misses a tensor leaves it visibly wrong."""
    for target in engine.weights.targets.values():
        target.tensor.normal_()


def engine_tensors(engine) -> dict[str, torch.Tensor]:
    w = engine.weights
    out = {"embed": w.embed.clone(), "final_norm": w.final_norm.clone()}
    for i, layer in enumerate(w.layers):
        for name in ("input_norm", "qkv", "qkv_bias", "o", "post_norm", "gate_up", "down"):
            out[f"{i}.{name}"] = getattr(layer, name).clone()
    return out


def generations(worker) -> dict:
    """Greedy and sampled responses to this rank's share of TEXTS (its tokens and log-probs)."""
    texts = [TEXTS[i] for i in SHARES[worker.rank]]
    out = {}
    for name, params in (("sampled", SAMPLED), ("greedy", GREEDY)):
        rollouts = worker.generate(texts, params, sample_ids=SHARES[worker.rank])
        out[name], out[f"{name}_logprobs"] = rollouts.response_ids, rollouts.logprobs
        out["prompts"] = rollouts.prompt_ids
    return out


def rank_main(rank: int, port: int, out: str) -> None:
    from rlscale.workers.distributed import fsdp_units
    from rlscale.workers.policy import PolicyWorker

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    tp = PolicyWorker(load_config(None, [*OVERRIDES, "policy.generation.tensor_parallel_size=2"]), rank, 2)
    assert (tp.tp.rank, tp.tp.size) == (rank, 2) and not tp.keep_gathered
    record, phase = [], ["streamed"]
    watch_weight_syncs(tp, record, phase)
    streamed = generations(tp)  # the engine's first sync is a streamed one
    synced = engine_tensors(tp._rollout)
    # each unit's gathered bytes (a DTensor's numel is the full parameter's)
    units = [param_bytes(tp.model.get_parameter(n) for n in names) for _, names in fsdp_units(tp.model)]
    # the whole-model sync (policy.keep_gathered=true's gathered path) into a corrupted engine
    corrupt(tp._rollout)
    tp.keep_gathered, phase[0] = True, "whole"
    whole = generations(tp)
    whole_tensors = engine_tensors(tp._rollout)
    # and streamed again, into a corrupted engine: the sync before each generation refills all
    corrupt(tp._rollout)
    tp.keep_gathered, phase[0] = False, "again"
    again = generations(tp)
    # T=1 on the same ranks: each rank generates its own share, keyed by the same sample ids
    one = PolicyWorker(load_config(None, OVERRIDES), rank, 2)
    assert one.tp is None
    single = generations(one)
    torch.save({"streamed": streamed, "whole": whole, "again": again, "single": single, "synced": synced,
                "whole_tensors": whole_tensors, "record": record, "units": units}, f"{out}/rank{rank}.pt")
    torch.distributed.barrier()  # both ranks tear down together (see tests/workers/test_distributed.py)
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("tp_workers")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(port, str(out)), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def full_model():
    from rlscale.models import load_model

    return load_model(load_config(None, OVERRIDES).policy.model_name, torch.float32, torch.device("cpu")).eval()


def expected_slices(model, rank: int, size: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s part of every engine tensor, cut from the full weights by plain chunking
    (heads and kv heads split evenly here; the vocabulary padded to a multiple of `size`)."""
    m = model.model
    vocab = m.embed_tokens.weight
    padded = -(-vocab.shape[0] // size) * size
    part = lambda t, dim=0: t.chunk(size, dim=dim)[rank]  # noqa: E731
    out = {"embed": torch.nn.functional.pad(vocab, (0, 0, 0, padded - vocab.shape[0])).chunk(size)[rank],
           "final_norm": m.norm.weight}
    for i, layer in enumerate(m.layers):
        attn, mlp = layer.self_attn, layer.mlp
        out[f"{i}.input_norm"] = layer.input_layernorm.weight
        out[f"{i}.post_norm"] = layer.post_attention_layernorm.weight
        out[f"{i}.qkv"] = torch.cat([part(attn.q_proj.weight), part(attn.k_proj.weight), part(attn.v_proj.weight)])
        out[f"{i}.qkv_bias"] = torch.cat([part(attn.q_proj.bias), part(attn.k_proj.bias), part(attn.v_proj.bias)])
        out[f"{i}.o"] = part(attn.o_proj.weight, 1)
        out[f"{i}.gate_up"] = torch.cat([part(mlp.gate_proj.weight), part(mlp.up_proj.weight)])
        out[f"{i}.down"] = part(mlp.down_proj.weight, 1)
    return out


def test_after_a_streamed_sync_each_rank_holds_its_slices_of_the_full_weights(two_ranks):
    model = full_model()
    for rank, result in enumerate(two_ranks):
        expected = expected_slices(model, rank, 2)
        assert result["synced"].keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(result["synced"][name], tensor.detach()), f"rank {rank}: {name}"
            assert torch.equal(result["whole_tensors"][name], tensor.detach()), f"rank {rank}: {name} (whole)"


def test_a_streamed_sync_holds_one_unit_gathered_at_a_time(two_ranks):
    for result in two_ranks:
        units, record = result["units"], result["record"]
        streamed = [r for r in record if r["phase"] != "whole"]
        # 4 one-layer units, then the root (embedding and final norm), at each of the 4 streamed
        # syncs (one before each of the streamed and again phases' 2 generations)
        assert len(units) == 5 and len(streamed) == 4 * len(units)
        assert [r["unit"] for r in streamed] == units * 4
        names = [name for r in streamed[:len(units)] for name in r["names"]]
        assert len(names) == len(set(names)) == 4 * 12 + 2  # each parameter handed over once (lm_head tied)
        for r in streamed:
            # nothing but the unit in hand is unsharded: the transient memory is that one unit
            assert r["unsharded"] == r["unit"], r
        largest, whole = max(units), sum(units)
        assert max(r["unsharded"] for r in streamed) == largest < whole / 2
        # the measure sees a gathered model: the whole-model sync holds every unit at once
        gathered = [r for r in record if r["phase"] == "whole"]
        assert len(gathered) == 2 and all(r["unsharded"] == r["unit"] == whole for r in gathered)


def test_generation_after_the_streamed_sync_equals_generation_after_the_whole_model_sync(two_ranks):
    for result in two_ranks:
        for name in ("sampled", "greedy", "sampled_logprobs", "greedy_logprobs"):
            assert result["streamed"][name] == result["whole"][name] == result["again"][name], name
        assert all(len(response) > 0 for response in result["streamed"]["sampled"])


def test_both_ranks_of_a_group_keep_their_own_share_of_one_batch(two_ranks):
    shares = [result["streamed"]["sampled"] for result in two_ranks]
    assert [len(share) for share in shares] == [len(ids) for ids in SHARES]
    assert shares[0] != shares[1]  # each rank its own prompts' samples, not the whole batch


def test_keyed_samples_do_not_depend_on_the_tensor_parallel_size(two_ranks):
    """T=2 generates the union of both ranks' prompts; T=1 each rank's own; the same sample ids
    key the same draws (up to a near-tie of the fp32 logits, see tests/rollout/sample_checks.py)."""
    from rlscale.rollout import Generation, SamplingMode
    from tests.rollout.sample_checks import assert_same_samples

    model = full_model()
    differing = 0
    for rank, result in enumerate(two_ranks):
        one, tp = result["single"], result["streamed"]
        assert one["prompts"] == tp["prompts"]
        for name, mode in (("greedy", SamplingMode(0.0)), ("sampled", SamplingMode(1.0))):
            as_generation = lambda out: Generation(out[name], out[f"{name}_logprobs"], [])  # noqa: E731
            differing += assert_same_samples(model, one["prompts"], as_generation(one), as_generation(tp), mode,
                                             SAMPLED.seed, SHARES[rank])
    assert differing <= 1
