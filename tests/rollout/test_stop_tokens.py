"""Stop token ids: the engine's lookup table for stop sets of any size, and the stop set a worker
builds from policy.generation.stop_token_ids, the tokenizer and the model's generation_config.json."""

import json
import random
import shutil

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlscale.models import load_tokenizer, stop_token_ids
from rlscale.models.loading import resolve_model_path
from rlscale.rollout import RolloutEngine, SamplingMode
from rlscale.rollout.stops import is_stop, stop_table

VOCAB = 1024  # room for a stop set of 600 ids


def tiny_qwen2():
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=256, pad_token_id=0,
                         eos_token_id=1, tie_word_embeddings=True)
    return Qwen2ForCausalLM(config).eval()


def reference_cut(row: list[int], stops: set[int]) -> tuple[list[int], bool]:
    """A free-running row cut by python membership: through its first stop id."""
    for j, token in enumerate(row):
        if token in stops:
            return row[:j + 1], True
    return row, False


def test_the_table_agrees_with_membership_for_any_set_and_any_token():
    g = torch.Generator().manual_seed(3)
    for size in (0, 1, 21, 22, 30, 600):
        ids = random.Random(size).sample(range(VOCAB), size)
        tokens = torch.randint(0, VOCAB + 50, (4096,), generator=g)  # past the largest id, and past V
        expected = torch.tensor([t in set(ids) for t in tokens.tolist()])
        assert torch.equal(is_stop(stop_table(ids, "cpu"), tokens), expected)
    assert stop_table([-1], "cpu").tolist() == [False]  # the engine's placeholder for no stop ids


@pytest.mark.parametrize("size", [1, 30, 600])
def test_generation_stops_at_any_id_of_a_stop_set_of_any_size(size):
    model = tiny_qwen2()
    g = torch.Generator().manual_seed(size)
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (5, 9, 3, 12, 7, 4)]
    engine = RolloutEngine(model, torch.device("cpu"), torch.float32, max_length=128, check_every=4)
    mode, new = SamplingMode(1.0), 20
    # keyed draws: a sample's tokens depend on its id and position only, so the stopped run draws
    # what the free run drew up to each stop
    free = engine.generate(prompts, new, mode, [1], 0, ignore_eos=True, seed=11)
    # the set holds a token of the second half of sequence 0's free run, and none of sequence 1's
    late = next(t for t in free.tokens[0][new // 2:] if t not in free.tokens[1])
    others = [t for t in range(VOCAB) if t != late and t not in free.tokens[1]]
    stops = sorted({late, *random.Random(size).sample(others, size - 1)})
    assert len(stops) == size
    out = engine.generate(prompts, new, mode, stops, 0, seed=11)
    expected = [reference_cut(row, set(stops)) for row in free.tokens]
    assert out.tokens == [row for row, _ in expected]
    assert out.stopped == [stopped for _, stopped in expected]
    assert any(out.stopped) and not out.stopped[1]  # sequence 1 holds no stop id: it runs to the end
    for row, free_row in zip(out.logprobs, free.logprobs):  # equal up to rounding (the batch may shrink)
        torch.testing.assert_close(torch.tensor(row), torch.tensor(free_row[:len(row)]), atol=1e-5, rtol=0)
    # ignore_eos ignores the whole set, as it did the single eos
    assert engine.generate(prompts, new, mode, stops, 0, ignore_eos=True, seed=11).tokens == free.tokens


def _two_eos_model_dir(tmp_path, eos_ids: list[int]):
    """The built-in tiny model, its generation_config.json listing `eos_ids`."""
    path = tmp_path / "two-eos"
    shutil.copytree(resolve_model_path("builtin:tiny-arith"), path)
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": eos_ids}))
    return path


def test_the_stop_set_holds_the_configured_ids_the_tokenizers_eos_and_the_models_eos_ids(tmp_path):
    tok = load_tokenizer("builtin:tiny-arith")
    assert stop_token_ids("builtin:tiny-arith", tok) == [tok.eos_token_id]
    assert stop_token_ids("builtin:tiny-arith", tok, [40, 7, 40]) == sorted({tok.eos_token_id, 7, 40})
    path = _two_eos_model_dir(tmp_path, [1, 30])
    assert stop_token_ids(str(path), tok, [9]) == sorted({tok.eos_token_id, 9, 30})
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 12}))  # an int, not a list
    assert stop_token_ids(str(path), tok) == sorted({tok.eos_token_id, 12})
    (path / "generation_config.json").unlink()  # no file: the tokenizer's eos alone
    assert stop_token_ids(str(path), tok, [5]) == sorted({tok.eos_token_id, 5})


@pytest.mark.parametrize("backend", ["engine", "hf"])
def test_a_model_whose_generation_config_lists_two_eos_ids_stops_at_both(tmp_path, backend):
    from rlscale.config_loading import load_config
    from rlscale.controller import sampling_params
    from rlscale.workers.policy import PolicyWorker

    torch.set_num_threads(1)
    texts = ["12+7", "305+96", "8+8", "41+120", "3+4", "77+5"]

    def worker(model: str) -> PolicyWorker:
        return PolicyWorker(load_config(None, [
            f"policy.model_name={model}", f"policy.generation.backend={backend}",
            "policy.generation.max_new_tokens=12", "policy.generation.stop_strings=[]"]))

    plain = worker("builtin:tiny-arith")
    params = sampling_params(plain.cfg, temperature=0.0)
    free = plain.generate(texts, params).response_ids
    eos = plain.tokenizer.eos_token_id

    def ends(stops: set[int]) -> set[int]:
        return {row[-1] for row, stopped in (reference_cut(r, stops) for r in free) if stopped}

    # the model's two eos ids (neither the tokenizer's): tokens at which the greedy responses of
    # this untrained prompt format would end, some at one, some at the other
    tokens = sorted({t for row in free for t in row} - {eos})
    a, b = next((a, b) for a in tokens for b in tokens if a < b and ends({eos, a, b}) >= {a, b})
    two = worker(str(_two_eos_model_dir(tmp_path, [a, b])))
    assert two.stop_ids == sorted({eos, a, b})
    out = two.generate(texts, params)
    expected = [reference_cut(row, {eos, a, b}) for row in free]
    assert out.response_ids == [row for row, _ in expected]
    assert out.truncated == [not stopped for _, stopped in expected]
    assert {row[-1] for row in out.response_ids} >= {a, b}  # some responses ended at each of the two
