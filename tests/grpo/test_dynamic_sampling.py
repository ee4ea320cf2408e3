"""Dynamic sampling's pure parts (rlscale.grpo.dynamic_sampling) against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from rlscale.config import prompts_per_round
from rlscale.grpo.dynamic_sampling import chosen_groups, informative_groups, sample_indices


def test_a_group_is_informative_when_its_rewards_differ():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.5, 0.5, 0.25]])
    assert informative_groups(rewards) == [False, False, True, True]


def test_one_sample_groups_are_never_informative():
    assert informative_groups(torch.tensor([[1.0], [0.0]])) == [False, False]


def test_informative_groups_wants_prompts_by_group():
    with pytest.raises(ValueError, match="prompts, group"):
        informative_groups(torch.tensor([1.0, 0.0]))


def test_the_first_informative_groups_in_generation_order_are_kept_and_the_surplus_dropped():
    informative = [False, True, True, False, True, True]  # two rounds of three groups
    assert chosen_groups(informative, 3) == [1, 2, 4]
    assert chosen_groups(informative, 10) == [1, 2, 4, 5]  # fewer than needed: all of them
    assert chosen_groups([False] * 4, 2) == []


def test_a_groups_samples_are_consecutive():
    assert sample_indices([1, 3], 2) == [2, 3, 6, 7]
    assert sample_indices([], 4) == []


@pytest.mark.parametrize(("prompts", "multiplier", "expected"),
                         [(8, 1.0, 8), (8, 1.5, 12), (8, 1.1, 9), (10, 1.1, 11), (32, 3.0, 96), (3, 1.01, 4)])
def test_a_round_draws_the_ceiling_of_prompts_times_the_multiplier(prompts, multiplier, expected):
    assert prompts_per_round(prompts, multiplier) == expected


def test_the_keys_load_under_nemo_rls_names_and_a_multiplier_alone_is_refused():
    from rlscale.config_loading import load_config
    from rlscale.errors import UserError

    cfg = load_config(None, ["grpo.use_dynamic_sampling=true", "grpo.batch_multiplier=3",
                             "grpo.dynamic_sampling_max_gen_batches=20", "grpo.num_prompts_per_step=16"])
    from rlscale.config import prompts_per_generation

    assert (cfg.grpo.batch_multiplier, cfg.grpo.dynamic_sampling_max_gen_batches) == (3.0, 20)
    assert prompts_per_generation(cfg) == 48
    assert prompts_per_generation(load_config(None, ["grpo.num_prompts_per_step=16"])) == 16
    with pytest.raises(UserError, match=r"grpo.batch_multiplier=2 is only read with grpo.use_dynamic_sampling=true"):
        load_config(None, ["grpo.batch_multiplier=2"])
    with pytest.raises(UserError, match="batch_multiplier"):
        load_config(None, ["grpo.use_dynamic_sampling=true", "grpo.batch_multiplier=0.5"])
    with pytest.raises(UserError, match="dynamic_sampling_max_gen_batches"):
        load_config(None, ["grpo.use_dynamic_sampling=true", "grpo.dynamic_sampling_max_gen_batches=0"])
