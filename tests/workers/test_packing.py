"""Packed micro-batches: the plan, the layout, and logprobs equal to each sample run alone."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from rlscale.grpo.loss import token_logprobs_and_entropy
from rlscale.models.logprob_head import packed_logprobs
from rlscale.models.packed_attention import packed_kwargs, use_packed_attention
from rlscale.workers.batch import build_train_batch
from rlscale.workers.packing import pack_batch, pack_documents, plan_packs
from rlscale.workers.model_setup import enable_activation_checkpointing


def test_plan_packs_respects_the_budget_and_keeps_every_document_once():
    lengths = [7, 3, 9, 2, 5, 5, 1, 8]
    packs = plan_packs(lengths, 10)
    assert sorted(i for p in packs for i in p) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in p) <= 10 for p in packs)
    assert packs == [[2, 6], [3, 7], [0, 1], [4, 5]]  # 9+1, 8+2, 7+3, 5+5
    assert plan_packs(lengths, 10) == packs  # deterministic
    assert sorted(plan_packs([12, 3], 10)) == [[0], [1]]  # too long: alone
    assert plan_packs([], 10) == []


def test_plan_packs_leaves_no_small_remainder():
    # 128 samples of 262 tokens in 32,768-token micro-batches: first-fit would make 125 + 3
    packs = plan_packs([262] * 128, 32768)
    assert [len(p) for p in packs] == [64, 64]
    lengths = [300 - i for i in range(100)]  # uneven lengths: token totals within one document
    totals = [sum(lengths[i] for i in p) for p in plan_packs(lengths, 10000)]
    assert len(totals) == 3 and max(totals) <= 10000 and max(totals) - min(totals) <= max(lengths)


def test_pack_batch_layout():
    batch = build_train_batch([[5, 6, 7], [8]], [[9, 10], [11, 12, 13]], [1.0, -1.0], pad_id=0, max_length=16)
    (mb,) = pack_batch(batch, 100)
    assert mb.input_ids.tolist() == [[5, 6, 7, 9, 10, 8, 11, 12, 13]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3]]
    assert mb.cu_seqlens.tolist() == [0, 5, 9] and mb.max_seqlen == 5
    assert mb.targets.tolist() == [9, 10, 11, 12, 13]
    assert mb.logit_index.tolist() == [2, 3, 5, 6, 7]
    assert (mb.rows.tolist(), mb.cols.tolist()) == ([0, 0, 1, 1, 1], [2, 3, 0, 1, 2])
    assert batch.response_mask[mb.rows, mb.cols].eq(1).all() and batch.response_mask.sum() == 5
    assert batch.input_ids[mb.rows, mb.cols + 1].tolist() == mb.targets.tolist()


def _tiny(kind):
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=97, max_position_embeddings=128)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**shape)) if kind == "qwen2" else LlamaForCausalLM(LlamaConfig(**shape))
    use_packed_attention(model, "sdpa")
    return model


def _alone(model, docs, starts):
    """Logprobs of each document's response from its own unpadded forward with full logits."""
    pieces = []
    for doc, start in zip(docs, starts):
        logits = model(input_ids=torch.tensor([doc])).logits
        lp, _ = token_logprobs_and_entropy(logits[:, :-1], torch.tensor([doc[1:]]))
        pieces.append(lp[0, start - 1:])
    return torch.cat(pieces)


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_packed_logprobs_and_gradients_equal_each_sample_alone(kind):
    model = _tiny(kind)
    gen = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (7, 12, 5, 9)]
    starts = [3, 4, 2, 8]
    mb = pack_documents(docs, starts, list(range(len(docs))))
    weights = torch.randn(len(mb.targets), generator=gen)

    packed, _ = packed_logprobs(model, mb, chunk=3)
    (packed * weights).sum().backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    alone = _alone(model, docs, starts)
    (alone * weights).sum().backward()

    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    for got, expected in zip(packed_grads, (p.grad for p in model.parameters())):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


def test_without_document_boundaries_later_documents_change():
    """The control: one causal pass over the packed row lets documents see each other."""
    model = _tiny("qwen2").eval()
    docs = [[3, 4, 5, 6, 7], [8, 9, 10, 11]]
    mb = pack_documents(docs, [1, 1], [0, 1])
    with torch.no_grad():
        alone = _alone(model, docs, [1, 1])
        crossing = model(input_ids=mb.input_ids, position_ids=mb.position_ids,
                         **packed_kwargs(torch.tensor([0, 9], dtype=torch.int32), 9)).logits
        lp, _ = token_logprobs_and_entropy(crossing[:, :-1], mb.input_ids[:, 1:])
    crossing_lp = lp[0, mb.logit_index]
    torch.testing.assert_close(crossing_lp[:4], alone[:4])  # the first document sees nothing before it
    assert (crossing_lp[4:] - alone[4:]).abs().max() > 1e-3


def test_generation_path_is_plain_sdpa():
    """Without packing keywords the switched model is transformers' SDPA, padding masks included."""
    model = _tiny("llama").eval()
    reference = _tiny("llama").eval()
    reference.set_attn_implementation("sdpa")
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits,
                                   reference(input_ids=ids, attention_mask=mask).logits)


def test_activation_checkpointing_gives_the_same_gradients():
    model = _tiny("qwen2").train()
    gen = torch.Generator().manual_seed(2)
    docs = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (9, 6)]
    mb = pack_documents(docs, [2, 3], [0, 1])

    def grads():
        model.zero_grad()
        logprobs, _ = packed_logprobs(model, mb)
        logprobs.sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    calls = []
    model.model.layers[0].self_attn.register_forward_hook(lambda *args: calls.append(1))
    plain = grads()
    assert len(calls) == 1
    enable_activation_checkpointing(model)
    checkpointed = grads()
    assert len(calls) == 3  # the forward, then its recomputation in the backward
    for got, expected in zip(checkpointed, plain):
        torch.testing.assert_close(got, expected)


def test_pack_batch_refuses_response_masks_it_cannot_represent():
    batch = build_train_batch([[5, 6, 7]], [[9, 10, 11]], [1.0], pad_id=0, max_length=16)
    batch.response_mask[0, 3] = 0  # a hole in the response
    with pytest.raises(ValueError, match="one span"):
        pack_batch(batch, 100)


def test_one_token_samples_pack_with_no_targets():
    # one-token prompts, empty responses: the response layout [B, L-1] has no columns at all
    batch = build_train_batch([[5], [6]], [[], []], [0.0, 0.0], pad_id=0, max_length=8)
    assert batch.response_mask.shape == (2, 0)
    (mb,) = pack_batch(batch, 100)
    assert mb.input_ids.tolist() == [[5, 6]] and mb.cu_seqlens.tolist() == [0, 1, 2]
    assert mb.targets.numel() == 0 and mb.logit_index.numel() == 0


def test_the_packed_backend_follows_where_and_in_what_the_model_computes():
    # fp32 master weights compute in bf16, and a sharded policy is switched while still on the
    # meta device: judged by its parameters, either would take the per-document SDPA loop
    # (a graph break and a host sync per layer) where the GPU has varlen FlashAttention
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=97, max_position_embeddings=128)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**shape))  # fp32 parameters on the meta device
    assert use_packed_attention(model, "auto") == "sdpa"
    assert use_packed_attention(model, "auto", torch.device("cuda"), torch.bfloat16) == "varlen"
    attention = model.model.layers[1].self_attn
    assert attention._rlscale_attention_backend == "varlen"
    assert use_packed_attention(model, "auto", torch.device("cuda"), torch.float32) == "sdpa"
    with pytest.raises(ValueError, match="varlen"):
        use_packed_attention(model, "varlen", torch.device("cpu"), torch.bfloat16)
