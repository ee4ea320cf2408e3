"""LoRA adapters (rlscale.models.lora, PEFT layers injected in place): the merged weights equal
PEFT's own merge, the reference (adapters off) is exactly the base, the rollout engine fed the
merged weights generates HF generate's greedy tokens on the adapted model, and the memory plan
counts PEFT's adapter parameters; bad settings are refused in one line."""

import copy

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlscale.config import LORA_LINEAR_MODULES, LoraConfig
from rlscale.config_loading import load_config
from rlscale.errors import UserError
from rlscale.memory_plan import ModelShape
from rlscale.models.lora import (BaseNamesView, adapter_layers, adapters_disabled, add_adapters, is_adapter,
                                 merged_by_layer, merged_parameters)
from rlscale.rollout import RolloutEngine, SamplingMode
from rlscale.rollout import TensorParallel
from rlscale.rollout.weights import DecodeWeights
from tests.rollout.test_engine import SMALL, hf_greedy, ragged_prompts
from tests.rollout.test_tensor_parallel import engine_slices


def adapted(targets=None, seed: int = 0):
    """A tiny Qwen2 (q/k/v biases, untied head) with LoRA, its B matrices made nonzero (PEFT
    starts them at zero, where every merge is trivially the base)."""
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**SMALL, tie_word_embeddings=False)).eval()
    base = copy.deepcopy(model)
    add_adapters(model, LoraConfig(enabled=True, rank=4, alpha=8.0, target_modules=targets))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return model, base


def test_only_the_adapters_train_in_fp32_and_the_base_keeps_its_dtype():
    model, _ = adapted()
    trained = {name: p for name, p in model.named_parameters() if p.requires_grad}
    assert trained and all(is_adapter(name) and p.dtype == torch.float32 for name, p in trained.items())
    assert len(adapter_layers(model)) == SMALL["num_hidden_layers"] * len(LORA_LINEAR_MODULES)


def test_merged_weights_equal_peft_merge_and_the_base_is_untouched():
    model, base = adapted()
    merged = dict(merged_parameters(model))
    assert set(merged) == {name for name, _ in base.named_parameters()}  # the base's own names
    peft_merged = copy.deepcopy(model)
    for layer in adapter_layers(peft_merged):
        layer.merge()
    peft_weights = {name.replace(".base_layer.", "."): p for name, p in peft_merged.named_parameters()
                    if not is_adapter(name)}
    for name, value in merged.items():
        torch.testing.assert_close(value.float(), peft_weights[name].float(), atol=1e-6, rtol=0, msg=name)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(merged[q], dict(base.named_parameters())[q])  # the adapters count
    for name, p in model.named_parameters():  # never merged in place
        if not is_adapter(name):
            assert torch.equal(p, dict(base.named_parameters())[name.replace(".base_layer.", ".")]), name
    groups = list(merged_by_layer(model))
    assert sum(map(len, groups)) == len(merged)
    assert len([g for g in groups if g[0][0].startswith("model.layers.")]) == SMALL["num_hidden_layers"]


def test_adapters_off_is_exactly_the_base_and_they_come_back_trainable():
    model, base = adapted()
    ids = torch.tensor([ragged_prompts()[3]])
    with torch.no_grad():
        with adapters_disabled(model):
            off = model(ids).logits
        on = model(ids).logits
        assert torch.equal(off, base(ids).logits)
        assert not torch.allclose(on, off)
    assert all(p.requires_grad for name, p in model.named_parameters() if is_adapter(name))


def test_engine_with_merged_weights_generates_hf_generates_tokens_on_the_adapted_model():
    model, _ = adapted()
    prompts = ragged_prompts()
    engine = RolloutEngine(BaseNamesView(model), torch.device("cpu"), torch.float32, max_length=128, sync=False)
    filled = [name for layer in merged_by_layer(model) for name in engine.weights.copy_named(layer)]
    assert engine.weights.missing_after(filled) == []
    out = engine.generate(prompts, 20, SamplingMode(temperature=0.0), eos_ids=[1], pad_id=0, ignore_eos=True)
    assert out.tokens == hf_greedy(model, prompts, 20)


@pytest.mark.parametrize("size", [2, 4])
def test_each_tensor_parallel_rank_merges_exactly_its_slice(size):
    """Each rank's engine, filled from the adapted model (every weight merged only over that
    rank's rows or columns), holds the slices of the merged model's full weights."""
    model, _ = adapted()
    plain = Qwen2ForCausalLM(Qwen2Config(**SMALL, tie_word_embeddings=False)).eval()
    plain.load_state_dict(dict(merged_parameters(model)))
    for rank in range(size):
        tp = TensorParallel(rank, size)
        merged = DecodeWeights(BaseNamesView(model), torch.device("cpu"), torch.float32, tp, sync=False)
        filled = [name for layer in merged_by_layer(model) for name in merged.copy_named(layer)]
        assert merged.missing_after(filled) == []
        expected = engine_slices(DecodeWeights(plain, torch.device("cpu"), torch.float32, tp))
        for name, tensor in engine_slices(merged).items():
            torch.testing.assert_close(tensor, expected[name], atol=1e-6, rtol=0, msg=f"rank {rank}: {name}")


def test_the_plan_counts_pefts_adapter_parameters():
    for targets in (None, ["q_proj", "v_proj"], ["down_proj"]):
        model, _ = adapted(targets)
        peft_count = sum(p.numel() for name, p in model.named_parameters() if is_adapter(name))
        shape = ModelShape.from_config(model.config.to_dict())
        assert shape.lora_parameters(4, targets or LORA_LINEAR_MODULES) == peft_count, targets


def test_a_target_the_model_lacks_is_named():
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**SMALL))
    lora = LoraConfig.model_construct(enabled=True, rank=4, alpha=8.0, dropout=0.0, target_modules=["c_attn"])
    with pytest.raises(UserError, match=r"policy.lora.target_modules: 'c_attn' match no linear layer of Qwen2ForCausalLM"):
        add_adapters(model, lora)


@pytest.mark.parametrize("overrides, message", [
    (["policy.lora.rank=0"], "rank"),
    (["policy.lora.target_modules=[q_proj,qkv]"], "'qkv' match no linear layer of a decoder block"),
    (["policy.lora.target_modules=[]"], "policy.lora.target_modules is empty"),
    (["policy.lora.enabled=true", "policy.master_weights=bf16_stochastic"],
     "policy.master_weights=bf16_stochastic with policy.lora.enabled=true"),
])
def test_bad_lora_settings_are_refused(overrides, message):
    with pytest.raises(Exception, match=message):
        load_config(None, overrides)


def test_nemo_rls_lora_cfg_keys_are_the_same_settings():
    cfg = load_config(None, ["policy.dtensor_cfg.lora_cfg.enabled=true", "policy.dtensor_cfg.lora_cfg.dim=32",
                             "policy.dtensor_cfg.lora_cfg.alpha=64", "policy.dtensor_cfg.lora_cfg.dropout=0.05",
                             "policy.dtensor_cfg.lora_cfg.target_modules=[q_proj,v_proj]",
                             "policy.dtensor_cfg.lora_cfg.match_all_linear=true"])
    lora = cfg.policy.lora
    assert (lora.enabled, lora.rank, lora.alpha, lora.dropout, lora.target_modules) == (
        True, 32, 64.0, 0.05, ["q_proj", "v_proj"])
