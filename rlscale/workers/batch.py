"""Token batches that travel between the controller and the policy workers."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Rollouts:
    """What a worker's generate returns: plain lists, cheap to send between processes."""

    prompt_ids: list[list[int]]  # rendered prompt tokens (chat template applied when used)
    response_ids: list[list[int]]  # sampled tokens, the final eos included when generated
    texts: list[str]  # decoded responses, special tokens removed
    truncated: list[bool]  # stopped by max_new_tokens rather than eos/stop string
    logprobs: list[list[float]] = field(default_factory=list)  # per response token, from the sampler (engine only)


@dataclass
class TrainBatch:
    """Right-padded prompt+response sequences; targets are input_ids shifted by one."""

    input_ids: torch.Tensor  # [B, L] long
    attention_mask: torch.Tensor  # [B, L] long, 1 on real tokens
    response_mask: torch.Tensor  # [B, L-1] float, 1 where the target is a response token
    advantages: torch.Tensor  # [B] float
    gen_logprobs: torch.Tensor | None = None  # [B, L-1] the sampler's logprobs of the targets, if reported

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def slice(self, start: int, stop: int) -> TrainBatch:
        """Rows start:stop, trimmed to their longest sequence to save compute."""
        width = int(self.attention_mask[start:stop].sum(1).max().item())
        return TrainBatch(
            input_ids=self.input_ids[start:stop, :width],
            attention_mask=self.attention_mask[start:stop, :width],
            response_mask=self.response_mask[start:stop, : width - 1],
            advantages=self.advantages[start:stop],
            gen_logprobs=None if self.gen_logprobs is None else self.gen_logprobs[start:stop, : width - 1],
        )

    def to(self, device: torch.device) -> TrainBatch:
        return TrainBatch(*(None if t is None else t.to(device) for t in (
            self.input_ids, self.attention_mask, self.response_mask, self.advantages, self.gen_logprobs)))


def build_train_batch(
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    advantages: list[float],
    pad_id: int,
    max_length: int,
    gen_logprobs: list[list[float]] | None = None,
) -> TrainBatch:
    """Concatenate each prompt with its response (right padding, positions from 0)."""
    rows = []
    for prompt, response in zip(prompt_ids, response_ids):
        keep = max(0, max_length - len(prompt))
        rows.append((prompt, response[:keep]))
    width = max(len(p) + len(r) for p, r in rows)
    size = len(rows)
    input_ids = torch.full((size, width), pad_id, dtype=torch.long)
    attention = torch.zeros((size, width), dtype=torch.long)
    response_mask = torch.zeros((size, max(width - 1, 1)), dtype=torch.float32)
    sampled = torch.zeros_like(response_mask) if gen_logprobs else None
    for i, (prompt, response) in enumerate(rows):
        total = len(prompt) + len(response)
        input_ids[i, :total] = torch.tensor(prompt + response, dtype=torch.long)
        attention[i, :total] = 1
        # target position t predicts token t+1: responses start at len(prompt)
        response_mask[i, len(prompt) - 1 : total - 1] = 1.0
        if sampled is not None:
            sampled[i, len(prompt) - 1 : total - 1] = torch.tensor(gen_logprobs[i][: len(response)])
    return TrainBatch(input_ids, attention, response_mask[:, : width - 1],
                      torch.tensor(advantages, dtype=torch.float32),
                      None if sampled is None else sampled[:, : width - 1])
