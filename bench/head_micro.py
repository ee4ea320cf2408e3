"""Micro-benchmark of the LM head's per-chunk pointwise kernels on a GPU: one 2048 × 151,936 bf16 chunk.

    python bench/head_micro.py        # writes $OUT/head_micro.json (or /tmp)

fwd_*: the forward (target logprob, log-partition, entropy; `_noent` without the entropy), as the
eager form `_chunk_forward` (three passes when compiled) and as `_chunk_forward_fused` (`fwd2pass`:
the entropy from the log-partition's exponentials); grad_*: `_chunk_grad_pointwise`. Each compiled
with dynamic=True (every shape symbolic, the vocabulary too), dynamic=None ("auto": the row count
made symbolic after a second count) and, for the gradient, static shapes. Times are CUDA-event
means over 20 calls after warm-up; max_err compares with the eager functions.
"""
import json
import os

import torch
from rlscale.grpo import loss

def timeit(fn, reps=20):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps): fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / reps * 1000  # us

dev = "cuda"
V, N = 151936, 2048
torch.manual_seed(0)
logits = (torch.randn(N, V, device=dev) * 3).to(torch.bfloat16)
logits_tail = logits[:1500].clone()
targets = torch.randint(0, V, (N,), device=dev)
grad = torch.randn(N, device=dev)
acc = torch.float32
res = {}
ref = loss._chunk_forward(logits, targets, True, acc)
for name, fn, dyn in [("fwd_dynamicTrue", loss._chunk_forward, True), ("fwd_auto", loss._chunk_forward, None),
                      ("fwd2pass_dynamicTrue", loss._chunk_forward_fused, True), ("fwd2pass_auto", loss._chunk_forward_fused, None)]:
    torch._dynamo.reset()
    c = torch.compile(fn, dynamic=dyn)
    c(logits_tail, targets[:1500], True, acc)  # a second row count first (auto: makes rows dynamic next)
    out = c(logits, targets, True, acc)
    err = max(float((a - b).abs().max()) for a, b in zip(out, ref))
    res[name] = {"us": timeit(lambda: c(logits, targets, True, acc)), "max_err_vs_eager": err}
    res[name + "_noent"] = {"us": timeit(lambda: c(logits, targets, False, acc))}
logz = ref[1]
gref = loss._chunk_grad(logits, logz, grad, targets, torch.bfloat16)
for name, dyn in [("grad_dynamicTrue", True), ("grad_auto", None), ("grad_static", False)]:
    torch._dynamo.reset()
    c = torch.compile(loss._chunk_grad_pointwise, dynamic=dyn)
    if dyn is not False:
        c(logits_tail, logz[:1500], grad[:1500], targets[:1500], torch.bfloat16)
    out = c(logits, logz, grad, targets, torch.bfloat16)
    res[name] = {"us": timeit(lambda: c(logits, logz, grad, targets, torch.bfloat16)),
                 "max_err_vs_eager": float((out.float() - gref.float()).abs().max())}
res["copy_bf16_us"] = timeit(lambda: logits.clone())
print(json.dumps(res, indent=1))
json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": [N, V], "results": res},
          open(os.path.join(os.environ.get("OUT", "/tmp"), "head_micro.json"), "w"), indent=1)
