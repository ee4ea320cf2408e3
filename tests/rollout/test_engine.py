"""The rollout engine against Hugging Face generate and the trainer's own logprobs."""

import shutil

import pytest
import torch
from transformers import (GPT2Config, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM)

from rlscale.rollout import RolloutEngine, SamplingMode, StopStrings, unsupported_reason
from rlscale.rollout.sampling import filter_logits, sample_tokens

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=97, max_position_embeddings=256, pad_token_id=0, eos_token_id=1)
FAMILIES = {
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**SMALL, tie_word_embeddings=True)),
    "llama3-rope": lambda: LlamaForCausalLM(LlamaConfig(**SMALL, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**SMALL, head_dim=32)),
}


def make(family: str):
    torch.manual_seed(0)
    return FAMILIES[family]().eval()


def ragged_prompts(seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 97, (n,), generator=g).tolist() for n in (5, 9, 3, 12, 7)]


def hf_greedy(model, prompts, new_tokens: int) -> list[list[int]]:
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[:, width:].tolist()


def recomputed_logprobs(model, prompt, response) -> torch.Tensor:
    full = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(full).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


@pytest.mark.parametrize("attention", ["sdpa", "matmul", "flex"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_tokens_equal_hf_generate_and_logprobs_equal_the_trainers(family, attention):
    model = make(family)
    prompts = ragged_prompts()
    engine = RolloutEngine(model, torch.device("cpu"), torch.float32, max_length=128, decode_attention=attention)
    out = engine.generate(prompts, 24, SamplingMode(temperature=0.0), eos_ids=[1], pad_id=0, ignore_eos=True)
    assert out.tokens == hf_greedy(model, prompts, 24)
    assert out.stopped == [False] * len(prompts)
    for prompt, tokens, logprobs in zip(prompts, out.tokens, out.logprobs):
        torch.testing.assert_close(torch.tensor(logprobs), recomputed_logprobs(model, prompt, tokens),
                                   atol=2e-5, rtol=0)


def test_bf16_logprobs_stay_finite_and_close_to_the_forward_pass():
    model = make("qwen2").to(torch.bfloat16)
    prompts = ragged_prompts(4)
    engine = RolloutEngine(model, torch.device("cpu"), torch.bfloat16, max_length=128)
    out = engine.generate(prompts, 24, SamplingMode(temperature=1.0), [1], 0, ignore_eos=True)
    for prompt, tokens, logprobs in zip(prompts, out.tokens, out.logprobs):
        torch.testing.assert_close(torch.tensor(logprobs), recomputed_logprobs(model, prompt, tokens),
                                   atol=0.05, rtol=0)  # finite, and within bf16 rounding


def test_sync_weights_copies_updates_in_place():
    model = make("qwen2")
    prompts = ragged_prompts(2)
    engine = RolloutEngine(model, torch.device("cpu"), torch.float32, max_length=128)
    before = engine.generate(prompts, 16, SamplingMode(0.0), [1], 0, ignore_eos=True).tokens
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    assert engine.generate(prompts, 16, SamplingMode(0.0), [1], 0, ignore_eos=True).tokens == before  # stale
    address = engine.weights.layers[0].qkv.data_ptr()
    engine.sync_weights(model)
    after = engine.generate(prompts, 16, SamplingMode(0.0), [1], 0, ignore_eos=True).tokens
    assert after == hf_greedy(model, prompts, 16) and after != before
    assert engine.weights.layers[0].qkv.data_ptr() == address  # captured graphs stay valid


def test_sequences_end_at_eos_and_report_how_they_ended():
    model = make("qwen2")
    prompts = ragged_prompts(3)
    engine = RolloutEngine(model, torch.device("cpu"), torch.float32, max_length=128)
    free = engine.generate(prompts, 12, SamplingMode(0.0), [1], 0, ignore_eos=True).tokens
    eos = free[0][4]  # pretend the 5th greedy token of sequence 0 is the end-of-sequence token
    out = engine.generate(prompts, 12, SamplingMode(0.0), eos_ids=[eos], pad_id=0)
    for row_free, row, stopped in zip(free, out.tokens, out.stopped):
        cut = row_free.index(eos) + 1 if eos in row_free else len(row_free)
        assert row == row_free[:cut] and stopped == (eos in row_free)
    assert out.tokens[0][-1] == eos and len(out.tokens[0]) <= 5


def test_a_stop_string_before_eos_cuts_a_sequence_that_ended_between_two_checks():
    # stop strings are looked for every check_every steps; a sequence that reached eos in between
    # must still be cut at a stop string that came before its eos
    model = make("qwen2")
    prompts = ragged_prompts(3)
    engine = RolloutEngine(model, torch.device("cpu"), torch.float32, max_length=128, check_every=16)
    torch.manual_seed(5)  # sampled (greedy rows of this model repeat one token); the same draws each time
    free = engine.generate(prompts, 12, SamplingMode(1.0), [1], 0, ignore_eos=True).tokens
    # sequence 0: its first two distinct tokens are the stop token and, later, the eos (both before
    # the first check, at step 16)
    firsts = sorted({token: free[0].index(token) for token in free[0]}.items(), key=lambda item: item[1])
    (stop, at), (eos, _) = firsts[0], firsts[1]

    def stop_check(index, row):
        return row.index(stop) + 1 if stop in row else None

    torch.manual_seed(5)
    out = engine.generate(prompts, 12, SamplingMode(1.0), eos_ids=[eos], pad_id=0, stop_check=stop_check)
    assert out.tokens[0] == free[0][:at + 1] and out.stopped[0]
    for row_free, row in zip(free[1:], out.tokens[1:]):  # the others: cut at whichever comes first
        ends = [row_free.index(t) + 1 for t in (eos, stop) if t in row_free]
        assert row == row_free[:min(ends, default=len(row_free))]


def test_stop_strings_cut_at_the_token_that_completes_the_string():
    from rlscale.models import load_tokenizer

    tok = load_tokenizer("builtin:tiny-arith")
    tokens = tok.encode("12+7=19 done", add_special_tokens=False)
    stop = StopStrings(tok, ["=1", "xyz"])
    assert tok.decode(tokens[:stop(0, tokens)]) == "12+7=1"
    assert StopStrings(tok, ["xyz"])(0, tokens) is None


def test_filter_logits_keeps_top_k_and_the_top_p_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = lambda out: torch.isfinite(out)[0].tolist()  # noqa: E731
    assert kept(filter_logits(logits, top_k=2, top_p=1.0)) == [True, True, False, False]
    assert kept(filter_logits(logits, top_k=None, top_p=0.7)) == [True, True, False, False]
    assert kept(filter_logits(logits, top_k=None, top_p=0.85)) == [True, True, True, False]
    assert kept(filter_logits(logits, top_k=None, top_p=0.4)) == [True, False, False, False]


def test_sampling_follows_the_tempered_distribution():
    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.log(probs).expand(20000, 4).contiguous()
    tokens, logprobs = sample_tokens(logits, SamplingMode(temperature=1.0))
    freq = torch.bincount(tokens, minlength=4).float() / len(tokens)
    torch.testing.assert_close(freq, probs, atol=0.015, rtol=0)
    torch.testing.assert_close(logprobs, torch.log(probs)[tokens])  # untempered, as the trainer computes
    tokens, _ = sample_tokens(logits, SamplingMode(temperature=0.5))
    sharp = probs ** 2 / (probs ** 2).sum()
    torch.testing.assert_close(torch.bincount(tokens, minlength=4).float() / len(tokens), sharp, atol=0.015, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampled_frequencies_pass_a_chi_square_test_against_the_tempered_softmax(temperature):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, generator=g)
    torch.manual_seed(1)
    draws = 40000
    tokens, _ = sample_tokens(logits.expand(draws, 16).contiguous(), SamplingMode(temperature))
    expected = torch.softmax(logits / temperature, -1) * draws
    assert expected.min() > 5  # the chi-square approximation holds
    chi2 = ((torch.bincount(tokens, minlength=16) - expected) ** 2 / expected).sum()
    assert chi2 < 37.70  # the 99.9% quantile of chi-square with 15 degrees of freedom


@pytest.mark.parametrize("mode", [SamplingMode(0.0), SamplingMode(1.0), SamplingMode(0.7, top_p=0.9),
                                  SamplingMode(1.3, top_k=5)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_are_the_untempered_log_softmax_at_the_chosen_tokens(mode, dtype):
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(64, 1000, generator=g) * 4).to(dtype)
    tokens, logprobs = sample_tokens(logits, mode)
    reference = torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(logprobs, reference, atol=1e-6, rtol=0)
    if not mode.greedy:  # and the chosen tokens survive top-k/top-p
        kept = torch.isfinite(filter_logits(logits.float() / mode.temperature, mode.top_k, mode.top_p))
        assert kept.gather(-1, tokens[:, None]).all()


def test_given_uniform_draws_the_sample_inverts_the_tempered_cdf():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(32, 500, generator=g)
    uniform = torch.rand(32, generator=g)
    mode = SamplingMode(0.8)
    rng = torch.get_rng_state()
    first, second = sample_tokens(logits, mode, uniform), sample_tokens(logits, mode, uniform)
    assert torch.equal(torch.get_rng_state(), rng)  # the draws given are all the randomness used
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    cdf = torch.softmax(logits.double() / 0.8, -1).cumsum(-1)
    assert torch.equal(first[0], torch.searchsorted(cdf, uniform.double()[:, None], right=True).squeeze(-1))


def test_a_capture_warm_up_before_prefill_changes_nothing():
    # on CUDA a mode's graph is captured after two warm-up steps on the state set for the
    # generation, before its prefill; the same warm-up here
    model = make("qwen2")
    prompts = ragged_prompts(6)
    engine = RolloutEngine(model, torch.device("cpu"), torch.float32, max_length=128)
    reference = engine.generate(prompts, 60, SamplingMode(0.0), [1], 0, ignore_eos=True)
    runner, warmed = engine._runner, []

    def runner_after_a_warm_up(mode, keyed=False):
        with engine._state_restored():
            engine._warm_up(mode, keyed)
        warmed.append(mode)
        return runner(mode, keyed)

    engine._runner = runner_after_a_warm_up
    out = engine.generate(prompts, 60, SamplingMode(0.0), [1], 0, ignore_eos=True)
    assert warmed == [SamplingMode(0.0)]  # once, before prefill
    assert out.tokens == reference.tokens and out.logprobs == reference.logprobs


needs_a_compiler = pytest.mark.skipif(not (shutil.which("g++") or shutil.which("clang++")),
                                      reason="torch.compile on CPU (inductor) needs a C++ compiler")


@needs_a_compiler
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_compiled_decode_and_sample_gives_the_eager_tokens(family):
    # inductor on CPU: the step compiled whole, once per mode (qwen3: with q/k norms). 15-19 s a
    # case with cold compile caches on 2 cores, 4-6 s warm; past dynamo's recompile limit a step
    # would quietly run eagerly: made an error here
    model = make(family)
    prompts = ragged_prompts(5)
    options = dict(max_length=128)
    eager = RolloutEngine(model, torch.device("cpu"), torch.float32, **options)
    compiled = RolloutEngine(model, torch.device("cpu"), torch.float32, compile_decode=True, **options)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for mode, new_tokens in ((SamplingMode(0.0), 100), (SamplingMode(1.0), 8)):
            # same seed: both make the same draws eagerly, so sampled tokens agree too
            outs = []
            for engine in (eager, compiled):
                torch.manual_seed(6)
                outs.append(engine.generate(prompts, new_tokens, mode, [1], 0, ignore_eos=True))
            assert outs[0].tokens == outs[1].tokens
            torch.testing.assert_close(torch.tensor(outs[0].logprobs), torch.tensor(outs[1].logprobs),
                                       atol=1e-5, rtol=0)


def test_models_outside_the_supported_families_are_named():
    assert "gpt2" in unsupported_reason(GPT2Config(n_layer=1, n_embd=32, n_head=2), 128)
    windowed = Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=32)
    assert "sliding-window" in unsupported_reason(windowed, 128)
    assert unsupported_reason(Qwen2Config(**SMALL), 128) is None
    with pytest.raises(ValueError, match="gpt2"):
        from transformers import GPT2LMHeadModel
        RolloutEngine(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2)), torch.device("cpu"),
                      torch.float32)


@needs_a_compiler
def test_compiled_top_p_filter_calls_the_running_sum_op_and_equals_eager():
    # the nucleus's running sum is an opaque op in compiled code (inductor's own scan failed on
    # CUDA at [64, 151936]); compiled it must still give eager's mask
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 4099, generator=g) * 3
    compiled = torch.compile(lambda x: filter_logits(x, top_k=50, top_p=0.9), dynamic=False)
    out = compiled(logits)
    assert torch.equal(torch.isfinite(out), torch.isfinite(filter_logits(logits, top_k=50, top_p=0.9)))
    assert 0 < int(torch.isfinite(out).sum(-1).min()) < 50  # the nucleus cut inside the top 50
    from torch._inductor.utils import run_and_get_code

    _, code = run_and_get_code(torch.compile(lambda x: filter_logits(x, None, 0.9), dynamic=False), logits)
    assert "rlscale.running_sum" in "\n".join(code)


@needs_a_compiler
def test_compiled_flex_decode_attention_reads_each_slots_own_blocks_of_the_pool_and_equals_masked_sdpa():
    # eager flex applies only the mask function; compiled flex (as on CUDA) also skips every block
    # the block mask does not list, so the list itself is checked here
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    from rlscale.rollout.forward import paged_block_mask

    slots, kv_heads, group, dim, block, pool = 4, 2, 7, 16, 16, 24
    g = torch.Generator().manual_seed(8)
    q = torch.randn(slots, kv_heads, group, dim, generator=g)
    keys, values = (torch.randn(kv_heads, (pool + 1) * block, dim, generator=g) for _ in range(2))
    positions = torch.tensor([0, 15, 40, 63])  # first, last and middle blocks
    table = torch.full((slots, 4), pool)  # the scratch block where a slot has no block
    owned = torch.randperm(pool, generator=g).tolist()  # blocks scattered over the pool
    logical = torch.zeros(pool + 1, dtype=torch.long)
    for slot, position in enumerate(positions.tolist()):
        for k in range(position // block + 1):
            table[slot, k] = owned.pop()
            logical[table[slot, k]] = k

    def attend(q, keys, values, positions):
        mask = paged_block_mask(table, logical, positions, block, keys.shape[1], group)
        return flex_attention(q, keys[None], values[None], block_mask=mask)

    def attend_last_block_only(q, keys, values, positions):  # the partly written block, without the full ones
        mask = paged_block_mask(table, logical, positions, block, keys.shape[1], group)
        last = BlockMask.from_kv_blocks(mask.kv_num_blocks, mask.kv_indices, BLOCK_SIZE=block, mask_mod=mask.mask_mod,
                                        seq_lengths=(group, keys.shape[1]), compute_q_blocks=False)
        return flex_attention(q, keys[None], values[None], block_mask=last)

    gather = (table[:, :, None] * block + torch.arange(block)).flatten(1)  # each slot's blocks in order
    visible = (torch.arange(gather.shape[1]) <= positions[:, None])[:, None, None, :]
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, keys[:, gather].transpose(0, 1), values[:, gather].transpose(0, 1), attn_mask=visible)
    out = torch.compile(attend, dynamic=False)(q, keys, values, positions)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(attend(q, keys, values, positions), expected, atol=1e-5, rtol=0)  # eager: the mask
    # every block before a slot's last is listed as full (no mask function there), the last as partial
    mask = paged_block_mask(table, logical, positions, block, keys.shape[1], group)
    assert mask.full_kv_num_blocks.flatten().tolist() == [0, 0, 2, 3] and mask.kv_num_blocks.flatten().tolist() == [1] * 4
    assert mask.kv_indices[:, 0, 0, 0].tolist() == table.gather(1, (positions // block)[:, None]).flatten().tolist()
    # the negative control: listing fewer blocks changes the slots whose positions pass the first
    short = torch.compile(attend_last_block_only, dynamic=False)(q, keys, values, positions)
    changed = (short - out).abs().amax(dim=(1, 2, 3))
    assert changed[:2].max() < 1e-5 and changed[2:].min() > 1e-2


def test_flex_decode_options_are_only_the_measured_ones_where_they_were_measured():
    from rlscale.rollout.forward import FLEX_DECODE_KERNEL_OPTIONS, default_flex_kernel_options

    # measured on Hopper only: elsewhere flex attention picks its own Triton options
    assert default_flex_kernel_options(torch.device("cpu")) == {}
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0):
        assert default_flex_kernel_options(torch.device("cuda")) == FLEX_DECODE_KERNEL_OPTIONS
    model = make("qwen2")
    assert RolloutEngine(model, torch.device("cpu"), torch.float32, 64).forward.flex_kernel_options == {}
    chosen = {"num_stages": 2}
    engine = RolloutEngine(model, torch.device("cpu"), torch.float32, 64, flex_kernel_options=chosen)
    assert engine.forward.flex_kernel_options == chosen
