"""What a generation samples (`SamplingParams`, `SamplingMode`), and sampling on the device: pure
functions of logits, safe to capture in a CUDA graph."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingMode:
    """The parts of the sampling parameters that change the captured computation."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


# Two classes, not one: SamplingMode is the key of the engine's captured graphs and what its
# compiled step specialises on, so it holds only what changes the device computation. The length
# sizes the engine's buffers and the stop strings are checked on the host, on decoded text; in the
# key they would only add captures (one per set of stop strings) of the same computation.
@dataclass
class SamplingParams:
    """A generation request: the sampling distribution, the longest response, the stop strings."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    max_new_tokens: int = 16
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None  # keyed draws (`keyed_uniform`): a sample's tokens independent of batch and T

    @property
    def mode(self) -> SamplingMode:
        return SamplingMode(self.temperature, self.top_p, self.top_k)


@torch.library.custom_op("rlscale::running_sum", mutates_args=())
def running_sum(x: torch.Tensor) -> torch.Tensor:
    """x.cumsum(-1) as an op torch.compile calls rather than generates: inductor's own scan over a
    [64, 151936] row failed to generate code (torch 2.11, H200, 2026-12-03: `SplitScan`, a
    TypeError in `get_block_shape`), crashing the compiled decode step with top-p at batch 64."""
    return x.cumsum(-1)


@running_sum.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def filter_logits(logits: torch.Tensor, top_k: int | None, top_p: float) -> torch.Tensor:
    """Mask tokens outside the top-k and outside the smallest set holding top_p of the mass."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already hold top_p (the first always stays)
        drop_sorted = (running_sum(probs) - probs) > top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def uniform_draws(rows: int, device) -> torch.Tensor:
    """One U[0, 1) draw per row for `inverse_cdf_tokens` (native RNG op, safe in a CUDA graph)."""
    return torch.rand(rows, dtype=torch.float32, device=device)


_MASK32 = 0xFFFFFFFF


def _fold32(x: torch.Tensor) -> torch.Tensor:
    """int64 -> its two 32-bit halves xor-ed, in [0, 2^32) (the identity on values already there)."""
    return (x ^ (x >> 32)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash, a bijection of [0, 2^32) held in int64 (hash-prospector's
    xorshift-multiply with shifts 16, 15, 15). Both multipliers are below 2^31, so a product of a
    value below 2^32 stays below 2^63: no int64 overflow on any device."""
    x = ((x ^ (x >> 16)) * 0x21F0AAAD) & _MASK32
    x = ((x ^ (x >> 15)) * 0x735A2D97) & _MASK32
    return x ^ (x >> 15)


def keyed_uniform(seed: int | torch.Tensor, sample_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """U[0, 1) draws [B] (float32, multiples of 2^-24) that are a pure function of (seed, sample
    id, position): the token a sample draws at a response position does not depend on the batch it
    is decoded in, its slot, or the tensor-parallel size. `sample_ids`, `positions`: int64 [B] (or
    broadcastable, e.g. a [1] step counter); `seed`: an int, or an int64 tensor already on their
    device (what a captured CUDA graph needs: the function is tensor ops only, no host sync)."""
    seed = torch.as_tensor(seed, dtype=torch.int64, device=sample_ids.device)
    h = _mix32(_fold32(seed) ^ 0x9E3779B9)  # the constant: seed 0 does not start from the fixed point 0
    h = _mix32(h ^ _fold32(sample_ids))
    h = _mix32(h ^ _fold32(positions))
    return (h >> 8).to(torch.float32) * 2.0 ** -24


def _below(x: torch.Tensor) -> torch.Tensor:
    """The largest float32 strictly below x (x > 0): a target that rounding cannot push past x."""
    return torch.nextafter(x, torch.zeros_like(x))


# Vocabulary entries per block of the blocked reductions below, at most. A row-wide reduction over
# ~150k entries leaves only B rows of parallel work (split into slow two-stage reductions under
# torch.compile); blocks give B × V / 1024 independent rows that one pass over the logits covers.
BLOCK = 1024


def block_size(vocab: int) -> int:
    """Entries per block for a vocabulary: the power of two giving about 128 blocks, within
    16..BLOCK (1024 for 150k-entry vocabularies; 16 for a 99-character one, where 1024-entry
    blocks would be mostly padding: 7 ms a CPU sampling call instead of 0.2 ms)."""
    size = 16
    while size < BLOCK and size * 128 < vocab:
        size *= 2
    return size


def vocab_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """[B, V] -> [B, ceil(V / block), block], padded with -inf (a padded entry has no mass)."""
    rows, vocab = x.shape
    pad = (-vocab) % block
    return torch.nn.functional.pad(x, (0, pad), value=float("-inf")).view(rows, (vocab + pad) // block, block)


def blocked_logsumexp(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`vocab_blocks` output [B, C, block] -> each block's logsumexp [B, C] and the row's [B, 1]:
    one parallel pass over the logits, then a reduction over C entries per row."""
    block_log_mass = torch.logsumexp(blocks, -1)
    return block_log_mass, torch.logsumexp(block_log_mass, -1, keepdim=True)


def flat_cdf(mass: torch.Tensor, sums: torch.Tensor | None = None) -> torch.Tensor:
    """Running sums of `mass` [..., n] (≥ 0) along the last axis that never decrease and stay
    exactly flat across entries without mass. A parallel scan (CUDA's cumsum, inductor's) adds in
    a tree, so its sum can rise by a rounding step at an entry of zero mass, where the search
    below could then land; zeroing those entries and carrying the running maximum rules it out.
    `sums`: the running sums as some scan computed them (default: `mass.cumsum(-1)`)."""
    sums = mass.cumsum(-1) if sums is None else sums
    return torch.where(mass > 0, sums, 0.0).cummax(-1).values


def inverse_cdf_tokens(scaled: torch.Tensor, uniform: torch.Tensor,
                       block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [B] drawn from softmax(scaled) [B, V] (float32; -inf excludes a token) by inverting
    its CDF at `uniform` [B] in [0, 1), and logsumexp(scaled) [B]. `block`: entries per block
    (default `block_size(V)`).

    One random number per row instead of one per vocabulary entry, and one pass over the logits:
    each block's log-mass (a logsumexp over its `block` entries), then, on [B, V / block], the
    block whose cumulative mass passes the target, then the token within that block. The CDFs are
    flat across entries without mass and targets are kept strictly below each cumulative total,
    so float rounding cannot land on a token of zero probability; indices are clamped into range
    so that non-finite logits give some token rather than an out-of-bounds read.
    """
    vocab = scaled.shape[-1]
    block = block or block_size(vocab)
    blocks = vocab_blocks(scaled, block)
    block_log_mass, log_total = blocked_logsumexp(blocks)  # [B, C], [B, 1]
    block_cdf = flat_cdf((block_log_mass - log_total).exp())
    target = torch.minimum(uniform[:, None] * block_cdf[:, -1:], _below(block_cdf[:, -1:]))
    chosen_block = torch.searchsorted(block_cdf, target, right=True).clamp(max=blocks.shape[1] - 1)  # [B, 1]
    before = torch.where(chosen_block > 0, block_cdf.gather(-1, (chosen_block - 1).clamp(min=0)), 0.0)
    inside = blocks.gather(1, chosen_block[:, :, None].expand(-1, -1, block)).squeeze(1)  # [B, block]
    within = flat_cdf((inside - log_total).exp())
    rest = torch.minimum((target - before).clamp(min=0.0), _below(within[:, -1:]))
    tokens = chosen_block * block + torch.searchsorted(within, rest, right=True)
    return tokens.squeeze(-1).clamp(max=vocab - 1), log_total.squeeze(-1)


def sample_tokens(logits: torch.Tensor, mode: SamplingMode,
                  uniform: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens [B] and their log-probabilities under the unmodified distribution [B].

    Log-probabilities are those the trainer recomputes (temperature 1, no filtering), so the two
    can be compared token by token. Sampling inverts the tempered, filtered distribution's CDF at
    one uniform draw per row (`inverse_cdf_tokens`): no sort, no host sync, and one random number
    per row rather than per vocabulary entry. `uniform` [B] (U[0, 1), float32) may come from
    outside: a compiled caller passes draws made eagerly, since random ops inside an inductor graph
    that is then captured in a CUDA graph may replay the same numbers.
    """
    logits = logits.float()
    log_total = None
    if mode.greedy:
        tokens = logits.argmax(-1)
    else:
        unmodified = mode.temperature == 1.0 and mode.top_k is None and mode.top_p >= 1.0
        scaled = logits if unmodified else filter_logits(logits / mode.temperature, mode.top_k, mode.top_p)
        if uniform is None:
            uniform = uniform_draws(logits.shape[0], logits.device)
        tokens, scaled_log_total = inverse_cdf_tokens(scaled, uniform)
        if unmodified:  # the sampling distribution is the model's own: its normaliser serves both
            log_total = scaled_log_total
    if log_total is None:
        log_total = blocked_logsumexp(vocab_blocks(logits, block_size(logits.shape[-1])))[1].squeeze(-1)
    return tokens, logits.gather(-1, tokens[:, None]).squeeze(-1) - log_total
