"""Generation through transformers `generate`: policy.generation.backend=hf, and the fallback for
the model families the rollout engine does not cover (rlscale.rollout.unsupported_reason)."""

from __future__ import annotations

import torch

from rlscale.models.prompts import decode_responses
from rlscale.rollout.sampling import SamplingParams
from rlscale.workers import distributed
from rlscale.workers.batch import Rollouts


def hf_generate(model, tokenizer, prompt_ids: list[list[int]], params: SamplingParams, device: torch.device,
                sharded: bool, stop_ids: list[int] | None = None) -> Rollouts:
    """transformers generate over one left-padded batch; sharded: the FSDP2 model is gathered for it.
    stop_ids: the token ids that end a response (`rlscale.models.stop_token_ids`; default: the
    tokenizer's eos id)."""
    from transformers import GenerationConfig

    tok = tokenizer
    stops = list(stop_ids) if stop_ids else [tok.eos_token_id]
    width = max(len(p) for p in prompt_ids)
    ids = torch.full((len(prompt_ids), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, prompt in enumerate(prompt_ids):
        ids[i, width - len(prompt):] = torch.tensor(prompt)
        mask[i, width - len(prompt):] = 1
    greedy = params.temperature == 0
    gen_config = GenerationConfig(
        do_sample=not greedy,
        temperature=None if greedy else params.temperature,
        top_p=None if greedy else params.top_p,
        top_k=None if greedy else (params.top_k or 0),
        max_new_tokens=params.max_new_tokens,
        pad_token_id=tok.pad_token_id,
        eos_token_id=stops,
        stop_strings=list(params.stop_strings) or None,
        use_cache=True,
    )
    model.eval()
    with distributed.gathered(model, sharded):
        # gathered weights: each rank decodes on its own, stopping when its own samples end
        out = model.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=gen_config,
            tokenizer=tok if params.stop_strings else None)
    new_tokens = out[:, width:].tolist()
    responses, truncated = [], []
    for row in new_tokens:
        cut = response_length(row, stops, tok.pad_token_id)
        responses.append(row[:cut])
        truncated.append(cut == params.max_new_tokens and row[cut - 1] not in stops)
    decoded = decode_responses(tok, responses)
    return Rollouts(prompt_ids=prompt_ids, response_ids=responses, texts=decoded, truncated=truncated)


def response_length(row: list[int], stop_ids: list[int], pad_id: int) -> int:
    """Tokens up to and including the first stop id; padding after an early stop is cut."""
    stops = set(stop_ids)
    for i, token in enumerate(row):
        if token in stops:
            return i + 1
        if token == pad_id:
            return i
    return len(row)
