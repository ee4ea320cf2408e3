"""Decode-step micro benchmarks at the rollout engine's Qwen2-0.5B shape (CUDA only).

    python bench/decode_micro.py [OUT.json]

Times, per call inside one CUDA graph of 24 calls (as in a decode step): the compiled flex
decode attention with flex's defaults, with Triton options (BLOCK_N × warps × stages), split-KV
and max-autotune; and the step's GEMMs at 256 rows eagerly, compiled and max-autotuned. It chose
`rlscale.rollout.forward.FLEX_DECODE_KERNEL_OPTIONS`; results:
bench/results/gen_2026-11-30_h200_qwen2-0.5b_decode-micro.json.
"""
import itertools
import json
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from rlscale.rollout.forward import FLEX_KV_BLOCK

def live_prefix_block_mask(positions: torch.Tensor, length: int, queries: int):
    """(The slotted cache's mask, before the paged one: kept here for this micro-benchmark.)
    Flex attention block mask for a decode step: slot b ([B] `positions`) sees cache positions
    0..positions[b] out of `length`, its `queries` query rows (the grouped heads) alike. Only the
    blocks holding those positions are listed, so the kernel never reads the dead rest of the cache;
    within them `kv_idx <= positions[b]` masks each position. Built once per step, from tensors only
    (no host sync), so it lives inside the compiled step and the CUDA graph."""
    from torch.nn.attention.flex_attention import BlockMask

    slots, blocks = positions.shape[0], -(-length // FLEX_KV_BLOCK)
    live = (positions // FLEX_KV_BLOCK + 1).clamp(max=blocks).to(torch.int32).view(slots, 1, 1)
    order = torch.arange(blocks, device=positions.device, dtype=torch.int32).expand(slots, 1, 1, blocks)

    def within_prefix(b, h, q_idx, kv_idx):
        return kv_idx <= positions[b]

    return BlockMask.from_kv_blocks(live, order.contiguous(), BLOCK_SIZE=FLEX_KV_BLOCK,
                                    mask_mod=within_prefix, seq_lengths=(queries, length), compute_q_blocks=False)


dev = "cuda"; dt = torch.bfloat16
B, Hkv, G, D, L = 256, 2, 7, 64, 384
out = {}

def graph_time(fn, calls=24, reps=50):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3): fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls): fn()
    g.replay(); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps): g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps / calls * 1e6

q = torch.randn(B, Hkv, G, D, device=dev, dtype=dt)
k = torch.randn(B, Hkv, L, D, device=dev, dtype=dt)
v = torch.randn(B, Hkv, L, D, device=dev, dtype=dt)
positions = torch.randint(64, 320, (B,), device=dev)

def make(opts, mode=None):
    def f(q, k, v, positions):
        bm = live_prefix_block_mask(positions, L, G)
        return flex_attention(q, k, v, block_mask=bm, kernel_options=opts)
    return torch.compile(f, dynamic=False, mode=mode)

cands = [("default", None, None), ("force_flex", {"FORCE_USE_FLEX_ATTENTION": True}, None)]
for bn, w, st in itertools.product([32, 64, 128], [2, 4], [1, 2, 3]):
    cands.append((f"decode_BN{bn}_w{w}_s{st}", {"BLOCK_N": bn, "num_warps": w, "num_stages": st}, None))
for sk in [1, 2, 4, 8]:
    cands.append((f"decode_split{sk}", {"SPLIT_KV": sk}, None))
cands.append(("max-autotune", None, "max-autotune-no-cudagraphs"))
ref = None
for name, opts, mode in cands:
    try:
        torch._dynamo.reset()
        fn = make(opts, mode)
        o = fn(q, k, v, positions)
        if ref is None: ref = o
        err = (o.float() - ref.float()).abs().max().item()
        us = graph_time(lambda: fn(q, k, v, positions))
        out[f"flex/{name}"] = {"us": us, "max_err": err}
        print(f"flex {name:28} {us:7.2f} us  err {err:.3g}", flush=True)
    except Exception as e:
        print(f"flex {name}: failed {type(e).__name__}: {str(e)[:150]}", flush=True)
        out[f"flex/{name}"] = {"error": str(e)[:300]}

# GEMMs of a decode step at 256 rows
shapes = {"qkv": (896, 1152, True), "o": (896, 896, True), "gate_up": (896, 9728, False),
          "down": (4864, 896, False), "lm_head": (896, 151936, False)}
for name, (kin, nout, bias) in shapes.items():
    x = torch.randn(B, kin, device=dev, dtype=dt)
    w = torch.randn(nout, kin, device=dev, dtype=dt) * 0.02
    b = torch.randn(nout, device=dev, dtype=dt) if bias else None
    res = {}
    for mode in [None, "max-autotune-no-cudagraphs"]:
        torch._dynamo.reset()
        f = torch.compile(lambda x, w, b: F.linear(x, w, b), dynamic=False, mode=mode)
        f(x, w, b)
        res[mode or "default"] = graph_time(lambda: f(x, w, b), calls=24 if name != "lm_head" else 4)
    res["eager"] = graph_time(lambda: F.linear(x, w, b), calls=24 if name != "lm_head" else 4)
    out[f"gemm/{name}"] = res
    print(f"gemm {name:8} " + "  ".join(f"{k} {v:.2f}us" for k, v in res.items()), flush=True)
with open(sys.argv[1] if len(sys.argv) > 1 else "decode_micro.json", "w") as f:
    json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": out}, f, indent=1)
