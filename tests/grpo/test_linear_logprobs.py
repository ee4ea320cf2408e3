"""Chunked LM head + log-softmax: same values and gradients as full logits."""

from __future__ import annotations

import math

import pytest
import torch

from rlscale.grpo.loss import linear_logprobs, token_logprobs_and_entropy


def _inputs(dtype=torch.float64, n=13, d=8, vocab=31):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, d, generator=gen, dtype=dtype, requires_grad=True)
    weight = torch.randn(vocab, d, generator=gen, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, vocab, (n,), generator=gen)
    upstream = torch.randn(n, generator=gen, dtype=torch.float32)
    return hidden, weight, targets, upstream


@pytest.mark.parametrize("chunk", [1, 4, 13, 100])
def test_values_and_gradients_match_full_logits(chunk):
    hidden, weight, targets, upstream = _inputs(dtype=torch.float32)
    full_lp, full_ent = token_logprobs_and_entropy((hidden @ weight.T)[None], targets[None], with_entropy=True)
    (full_lp[0] * upstream).sum().backward()
    expected = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    lp, ent = linear_logprobs(hidden, weight, targets, with_entropy=True, chunk=chunk)
    (lp * upstream).sum().backward()
    torch.testing.assert_close(lp, full_lp[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, full_ent[0], rtol=1e-5, atol=3e-5)  # both float32: cancellation
    torch.testing.assert_close(hidden.grad, expected[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weight.grad, expected[1], rtol=1e-5, atol=1e-5)


def test_gradcheck():
    hidden, weight, targets, _ = _inputs(n=5, d=3, vocab=7)
    assert torch.autograd.gradcheck(lambda h, w: linear_logprobs(h, w, targets, chunk=2)[0].double(),
                                    (hidden, weight))


def test_bfloat16_stays_close_to_float32():
    hidden, weight, targets, upstream = _inputs(dtype=torch.float32, n=40, d=16, vocab=50)
    lp32, _ = linear_logprobs(hidden, weight, targets, chunk=8)
    (lp32 * upstream).sum().backward()
    h16 = hidden.detach().bfloat16().requires_grad_()
    w16 = weight.detach().bfloat16().requires_grad_()
    lp16, _ = linear_logprobs(h16, w16, targets, chunk=8)
    (lp16 * upstream).sum().backward()
    assert lp16.dtype == torch.float32 and w16.grad.dtype == torch.bfloat16
    torch.testing.assert_close(lp16, lp32, rtol=0.05, atol=0.1)
    torch.testing.assert_close(w16.grad.float(), weight.grad, rtol=0.05, atol=0.05)


def test_no_graph_without_grad():
    hidden, weight, targets, _ = _inputs()
    with torch.no_grad():
        lp, ent = linear_logprobs(hidden, weight, targets)
    assert not lp.requires_grad and ent is None


def test_compiled_chunk_kernels_trace_whole_and_agree(monkeypatch):
    """policy.compile fuses the chunk arithmetic; aot_eager checks the tracing without a C compiler.
    Full chunks take the static compilation, the last (shorter) chunk the other, and the fused
    forward (entropy from the log-partition's exponentials) agrees with the eager form."""
    from rlscale.grpo import loss

    calls, made = [], {}

    def compile_recorded(fn):
        role = "full" if fn.__name__ not in made else "other"  # _by_rows compiles full, then other
        made[fn.__name__] = role
        compiled = torch.compile(fn, dynamic=False, backend="aot_eager", fullgraph=True)

        def run(logits, *args):
            calls.append((fn.__name__, role, logits.shape[0]))
            return compiled(logits, *args)

        return run

    monkeypatch.setattr(loss, "_compile", compile_recorded)
    monkeypatch.setattr(loss, "_COMPILED", {})
    hidden, weight, targets, upstream = _inputs(dtype=torch.float32)
    results = []
    for use_compiled in (True, False):
        hidden.grad = weight.grad = None
        lp, ent = linear_logprobs(hidden, weight, targets, with_entropy=True, chunk=5, compiled=use_compiled)
        (lp * upstream).sum().backward()
        results.append((lp, ent, hidden.grad.clone(), weight.grad.clone()))
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected)
    # 13 rows in chunks of 5: two full chunks (static) and one of 3 rows (the other), forward and backward
    for name in ("_chunk_forward_fused", "_chunk_grad_pointwise"):
        assert [(role, rows) for n, role, rows in calls if n == name] == [("full", 5), ("full", 5), ("other", 3)]


def test_the_compiled_chunk_kernels_compile_a_bounded_number_of_times(monkeypatch):
    """Every pack ends in a chunk of another row count, sliced at another offset: those must not
    recompile (past dynamo's limit, 8 per function, the kernels would silently run eagerly)."""
    from torch._dynamo.testing import CompileCounter

    from rlscale.grpo import loss

    def frames(row_counts):
        torch._dynamo.reset()
        counter = CompileCounter()
        monkeypatch.setattr(loss, "_compile", lambda fn: torch.compile(fn, dynamic=False, backend=counter))
        monkeypatch.setattr(loss, "_COMPILED", {})
        gen = torch.Generator().manual_seed(5)
        weight = torch.randn(31, 8, generator=gen, requires_grad=True)
        for n in row_counts:
            hidden = torch.randn(n, 8, generator=gen, requires_grad=True)
            targets = torch.randint(0, 31, (n,), generator=gen)
            for with_entropy in (True, False):
                lp, _ = linear_logprobs(hidden, weight, targets, with_entropy=with_entropy, chunk=4, compiled=True)
                lp.sum().backward()
        return counter.frame_count

    few = frames([4, 9, 6])  # full chunks and tails of 1 and 2 rows
    many = frames([4, 9, 6, 7, 11, 13, 14, 19, 22, 27, 29, 30, 33, 37, 41])
    # forward: full × entropy on/off, other × entropy on/off × (1 row, several); gradient: full, other × 2
    assert few == many == 9


def test_the_fused_forward_matches_the_eager_one_with_extreme_logits():
    from rlscale.grpo.loss import _chunk_forward, _chunk_forward_fused

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 50, generator=gen, dtype=torch.float64) * torch.tensor([1, 10, 100, 1e3, 1e4, 0.0])[:, None]
    targets = torch.randint(0, 50, (6,), generator=gen)
    for got, expected in zip(_chunk_forward_fused(logits, targets, True, torch.float64),
                             _chunk_forward(logits, targets, True, torch.float64)):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-9)
    uniform = _chunk_forward_fused(torch.zeros(1, 50, dtype=torch.float64), targets[:1], True, torch.float64)
    torch.testing.assert_close(uniform[2], torch.tensor([math.log(50)], dtype=torch.float64))


# --- the head fused with a per-token loss (its gradient taken in the forward) --------------------

def _grpo_token_loss(n, dtype):
    """A GRPO token loss over n tokens (clipping and KL both active), as the policy builds it."""
    from rlscale.grpo.loss import grpo_token_loss

    gen = torch.Generator().manual_seed(1)
    old = -torch.rand(n, generator=gen, dtype=dtype) * 3
    ref = -torch.rand(n, generator=gen, dtype=dtype) * 3
    advantages = torch.randn(n, generator=gen, dtype=dtype)
    weights = torch.rand(n, generator=gen, dtype=dtype)

    def token_loss(logprobs, part=slice(None)):
        terms = grpo_token_loss(logprobs[None], old[part][None], advantages[part][None], ref[part][None],
                                clip_low=0.2, clip_high=0.28, kl_beta=0.1)
        return terms.loss[0] * weights[part]

    return token_loss


@pytest.mark.parametrize("chunk", [1, 4, 13, 100])
def test_fused_loss_has_the_values_and_gradients_of_the_loss_on_linear_logprobs(chunk):
    from rlscale.grpo.loss import linear_logprobs_loss

    hidden, weight, targets, _ = _inputs()
    token_loss = _grpo_token_loss(hidden.shape[0], hidden.dtype)
    lp, ent = linear_logprobs(hidden, weight, targets, with_entropy=True, chunk=chunk)
    losses = token_loss(lp)
    losses.sum().backward()
    expected = lp.detach(), ent, losses.detach(), hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    got_lp, got_ent, got_losses = linear_logprobs_loss(hidden, weight, targets, token_loss, with_entropy=True,
                                                       chunk=chunk)
    assert not got_lp.requires_grad and got_losses.requires_grad
    got_losses.sum().backward()
    assert (expected[2] != 0).all()  # every token's term counts
    for got, want in zip((got_lp, got_ent, got_losses, hidden.grad, weight.grad), expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_fused_loss_in_bfloat16_matches_the_unfused_head():
    from rlscale.grpo.loss import linear_logprobs_loss

    hidden, weight, targets, _ = _inputs(dtype=torch.float32, n=40, d=16, vocab=50)
    token_loss = _grpo_token_loss(40, torch.float32)
    grads = []
    for fused in (False, True):
        h16 = hidden.detach().bfloat16().requires_grad_()
        w16 = weight.detach().bfloat16().requires_grad_()
        if fused:
            _, _, losses = linear_logprobs_loss(h16, w16, targets, token_loss, chunk=8)
        else:
            losses = token_loss(linear_logprobs(h16, w16, targets, chunk=8)[0])
        losses.sum().backward()
        assert w16.grad.dtype == h16.grad.dtype == torch.bfloat16
        grads.append((h16.grad, w16.grad))
    for got, want in zip(*grads):  # same arithmetic, in the same order: identical
        assert torch.equal(got, want)


def test_fused_loss_refuses_anything_but_the_sum_of_its_losses():
    from rlscale.grpo.loss import linear_logprobs_loss

    hidden, weight, targets, upstream = _inputs()
    _, _, losses = linear_logprobs_loss(hidden, weight, targets, _grpo_token_loss(13, torch.float64), chunk=4)
    with pytest.raises(RuntimeError, match="backpropagate losses.sum"):
        (losses * upstream.double()).sum().backward()


# --- the chunk gradient kernel and the head's float32 grad_weight ----------------------------------

def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns (torch.equal calls -0.0 and +0.0 equal; these differ)."""
    return t.view({torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16}[t.dtype])


@pytest.mark.parametrize("dtype,out_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.float64, torch.float64)])
def test_the_compiled_chunk_gradient_is_the_scatter_formula_bit_for_bit(dtype, out_dtype):
    """The pointwise form (one pass when compiled) makes the scatter's additions: the same bits,
    signed zeros included (rows with a zero upstream gradient, logits at -inf)."""
    from rlscale.grpo.loss import _chunk_grad, _chunk_grad_pointwise

    gen = torch.Generator().manual_seed(3)
    rows, vocab = 96, 50
    logits = (torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * 6).to(dtype)
    logits[5, :7] = float("-inf")
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    targets[2] = targets[3]  # rows on one token
    acc = torch.promote_types(dtype, torch.float32)
    logz = torch.logsumexp(logits.to(acc), -1)
    grad = torch.randn(rows, generator=gen, dtype=torch.float64).to(acc)
    grad[::7] = 0.0  # clipped tokens: -grad · p is -0.0 there
    scattered = _chunk_grad(logits, logz, grad, targets, out_dtype)
    pointwise = _chunk_grad_pointwise(logits, logz, grad, targets, out_dtype)
    assert scattered.dtype == pointwise.dtype == out_dtype
    assert torch.equal(_bits(scattered), _bits(pointwise))
    assert torch.signbit(scattered[0::7]).any()  # the signed zeros are there to compare
    # and it is the gradient of sum(grad · logprob[target])
    leaf = logits.to(acc).requires_grad_()
    (torch.log_softmax(leaf, -1).gather(-1, targets[:, None]).squeeze(-1) * grad).sum().backward()
    loose = out_dtype == torch.bfloat16
    torch.testing.assert_close(scattered.to(acc), leaf.grad, atol=1e-2 if loose else 1e-6, rtol=1e-2 if loose else 1e-5)


def test_grad_weight_accumulates_in_the_buffer_precision():
    from rlscale.grpo.loss import _add_product

    gen = torch.Generator().manual_seed(4)
    acc = torch.randn(6, 5, generator=gen)
    a, b = torch.randn(6, 8, generator=gen), torch.randn(8, 5, generator=gen)
    torch.testing.assert_close(_add_product(acc.clone(), a, b), acc + a @ b)
    # bf16 inputs on CPU: the product is rounded to bf16, then added to the float32 buffer
    a16, b16 = a.bfloat16(), b.bfloat16()
    assert torch.equal(_add_product(acc.clone(), a16, b16), acc + (a16 @ b16).float())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLAS's float32 output for bf16 inputs is CUDA-only")
def test_grad_weight_on_cuda_adds_the_unrounded_product():
    from rlscale.grpo.loss import _add_product

    gen = torch.Generator(device="cuda").manual_seed(5)
    acc = torch.zeros(64, 32, device="cuda")
    a = torch.randn(64, 256, device="cuda", generator=gen).bfloat16() * 1e-3
    b = torch.randn(256, 32, device="cuda", generator=gen).bfloat16()
    exact = a.float() @ b.float()
    for _ in range(4):
        acc = _add_product(acc, a, b)
    assert acc.dtype == torch.float32
    rounded_each_time = torch.zeros_like(acc)
    for _ in range(4):
        rounded_each_time += (a @ b).float()
    assert (acc - 4 * exact).abs().max() < (rounded_each_time - 4 * exact).abs().max()
