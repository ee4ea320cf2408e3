"""On a CUDA device: varlen FlashAttention over a packed row matches per-sample attention.

Skipped without CUDA (the CPU suite checks the per-sample SDPA backend exactly, in
test_packing.py); `pytest -m gpu` on a GPU machine runs these.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlscale.models.logprob_head import packed_logprobs
from rlscale.models.packed_attention import use_packed_attention
from rlscale.workers.packing import pack_documents
from rlscale.workers.model_setup import compile_layers

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _model(backend: str, seed: int = 0):
    torch.manual_seed(seed)
    config = Qwen2Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=1000, max_position_embeddings=1024)
    model = Qwen2ForCausalLM(config).to("cuda", torch.bfloat16)
    assert use_packed_attention(model, backend) == backend
    return model


@pytest.mark.parametrize("compiled", [False, True])
def test_varlen_matches_per_sample_sdpa_in_values_and_gradients(compiled):
    # compiled layers hand attention q/k in another memory layout than eager ones (varlen takes
    # them as strided views)
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (300, 17, 129, 64)]
    mb = pack_documents(docs, [10, 3, 100, 1], list(range(4))).to(torch.device("cuda"))
    results = []
    for backend in ("varlen", "sdpa"):
        model = _model(backend)
        if compiled and backend == "varlen":
            compile_layers(model)
        logprobs, entropy = packed_logprobs(model, mb, with_entropy=True, chunk=128)
        logprobs.sum().backward()
        results.append((logprobs.detach(), entropy, [p.grad.float() for p in model.parameters()]))
    (lp_v, ent_v, grads_v), (lp_s, ent_s, grads_s) = results
    assert (lp_v - lp_s).abs().max() < 0.05 and (ent_v - ent_s).abs().max() < 0.05
    for got, expected in zip(grads_v, grads_s):
        assert (got - expected).norm() <= 0.05 * expected.norm() + 1e-3
