"""The policy worker's two generation backends agree, and the engine's logprobs reach the controller."""

import torch

from rlscale.config_loading import load_config
from rlscale.controller import sampling_params
from rlscale.workers.policy import PolicyWorker


def worker(backend: str, *extra: str) -> PolicyWorker:
    torch.set_num_threads(1)
    cfg = load_config(None, [f"policy.generation.backend={backend}", "policy.generation.max_new_tokens=12",
                             "policy.generation.stop_strings=[]", *extra])
    return PolicyWorker(cfg)


def test_engine_and_transformers_generate_give_the_same_greedy_rollouts():
    texts = ["12+7", "305+96", "8+8", "41+120"]
    engine, hf = worker("engine"), worker("hf")
    params = sampling_params(engine.cfg, temperature=0.0)
    a, b = engine.generate(texts, params), hf.generate(texts, params)
    assert engine._rollout is not None  # the engine generated, not the fallback
    assert a.response_ids == b.response_ids and a.texts == b.texts and a.truncated == b.truncated
    assert [len(lp) for lp in a.logprobs] == [len(r) for r in a.response_ids]
    assert all(lp <= 0 for row in a.logprobs for lp in row) and b.logprobs == []
    assert set(engine.last_generation_timings) >= {"prefill_s", "decode_s"}


def test_the_update_reports_how_far_sampler_and_trainer_logprobs_disagree():
    from rlscale.workers.batch import build_train_batch

    w = worker("engine")
    rollouts = w.generate(["12+7", "305+96", "8+8", "41+120"], sampling_params(w.cfg))
    pad = w.tokenizer.pad_token_id

    def error(logprobs, trainer) -> float:
        batch = build_train_batch(rollouts.prompt_ids, rollouts.response_ids, [1.0, -1.0, 0.5, -0.5], pad, 64,
                                  logprobs)
        tokens = float(sum(map(len, rollouts.response_ids)))
        return trainer.train([batch], [tokens], 4, 4)["token_mult_prob_error"]

    # measured before the update changes the weights: a fresh worker (same seed) for each check
    assert abs(error(rollouts.logprobs, w) - 1.0) < 1e-4  # same weights, same tokens: fp32 agreement
    shifted = [[lp + 0.5 for lp in row] for row in rollouts.logprobs]
    assert abs(error(shifted, worker("engine")) - 2.718281828 ** 0.5) < 1e-4
