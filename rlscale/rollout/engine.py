"""The rollout engine: batched prefill, a slotted KV cache, decode steps replayed as CUDA graphs.

    engine = RolloutEngine(policy_model, device, dtype)
    engine.sync_weights(policy_model)           # after every update; copies in place, no disk
    out = engine.generate(prompt_ids, max_new_tokens=256, mode=SamplingMode(1.0), eos_ids=[eos])

A compiled decode step on CUDA attends through flex attention with a block mask of each
sequence's live cache blocks, built on the device every step, so one graph serves every length.
On CUDA each (batch bucket, cache length, sampling mode) gets one captured graph, captured before
the prefill of the first generation that needs it; the host loop replays it and, every
`check_every` steps, reads back whether all sequences have stopped. With `compile_decode` the
step (forward and sampling) is compiled whole before capture. On CPU the same step runs eagerly
(the path the tests exercise).

Tensor parallelism (`tp`, `tensor_parallel.py`): every rank of the group runs the same
`generate` on the same prompts with 1/T of the weights; the forward pass all-reduces and gathers
inside each step (`forward.py`), so all ranks hold the same full logits, sample the same tokens
(keyed draws: `seed`) and take the same host decisions (stops, early exit), calling the same
collectives in the same order. With an NCCL group the decode step stays one capturable unit, its
collectives inside the CUDA graph (NCCL kernels can be captured; untested here, CPU only); with
gloo (CPU tests) collectives cannot be captured, so graphs and compile are off.

Keyed sampling (`generate(..., seed=)`): each draw is `keyed_uniform(seed, the slot's sample id,
the token's position in the response)`, prefill's first token included, so a sample's tokens do
not depend on its batch, its slot or T; the seed and ids sit in the decode state's static buffers.
"""

from __future__ import annotations

import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from rlscale.rollout.forward import DecoderForward, KVCache, rotary_table
from rlscale.rollout.sampling import SamplingMode, keyed_uniform, sample_tokens, uniform_draws
from rlscale.rollout.tensor_parallel import TensorParallel
from rlscale.rollout.weights import DecodeWeights, unsupported_reason


@dataclass
class Generation:
    """Per sequence: sampled tokens (through the first eos/stop), their logprobs, how it ended."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    stopped: list[bool]  # ended by eos or a stop string (False: ran into max_new_tokens)
    timings: dict[str, float] = field(default_factory=dict)


def batch_bucket(size: int) -> int:
    """Graphs are captured for a few batch sizes; a batch runs in the smallest that fits."""
    bucket = 8
    while bucket < size:
        bucket *= 2
    return bucket


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class _DecodeState:
    """Static buffers a captured decode step reads and writes (addresses never change)."""

    def __init__(self, slots: int, max_new_tokens: int, device, pad_id: int, eos_ids: list[int]):
        self.tokens = torch.full((slots,), pad_id, dtype=torch.long, device=device)
        self.positions = torch.zeros(slots, dtype=torch.long, device=device)
        self.done = torch.ones(slots, dtype=torch.bool, device=device)
        self.step = torch.zeros(1, dtype=torch.long, device=device)
        self.out_tokens = torch.full((slots, max_new_tokens), pad_id, dtype=torch.long, device=device)
        self.out_logprobs = torch.zeros(slots, max_new_tokens, dtype=torch.float32, device=device)
        self.eos = torch.tensor(eos_ids or [-1], dtype=torch.long, device=device)
        self.pad_id = pad_id
        # keyed draws: read by the step, set per generation (sample ids of padding slots unused)
        self.seed = torch.zeros(1, dtype=torch.long, device=device)
        self.sample_ids = torch.zeros(slots, dtype=torch.long, device=device)

    def draws(self, rows: slice, mode: SamplingMode, keyed: bool) -> torch.Tensor | None:
        """The uniform draws for slots `rows`' tokens at response position `step` (None: greedy)."""
        if mode.greedy:
            return None
        ids = self.sample_ids[rows]
        return keyed_uniform(self.seed, ids, self.step) if keyed else uniform_draws(len(ids), ids.device)

    def written(self) -> list[torch.Tensor]:
        """The buffers a decode step writes (besides the KV cache)."""
        return [self.tokens, self.positions, self.done, self.step, self.out_tokens, self.out_logprobs]


class RolloutEngine:
    def __init__(self, source_model, device: torch.device, dtype: torch.dtype, max_length: int = 2048,
                 use_cuda_graphs: bool | None = None, check_every: int = 16, prefill_tokens: int = 16384,
                 compile_decode: bool = False, decode_attention: str = "auto", compile_mode: str | None = None,
                 flex_kernel_options: dict | None = None, tp: TensorParallel | None = None, sync: bool = True):
        """tp: this rank's place in a tensor-parallel group (None, or size 1: one device holds the
        whole model). sync=False: the weights are left unfilled, for a streamed first sync through
        `weights.copy_named` before the first generation."""
        reason = unsupported_reason(source_model.config, max_length)
        if reason:
            raise ValueError(f"rollout engine does not support {reason}")
        self.tp = tp if tp is not None and tp.size > 1 else None
        if self.tp is not None and not self.tp.capturable():
            if use_cuda_graphs or compile_decode:
                warnings.warn("rollout engine: CUDA graphs and compile are off under a non-NCCL tensor-parallel "
                              "group (its collectives cannot be captured)", stacklevel=2)
            use_cuda_graphs, compile_decode = False, False
        self.device, self.dtype = torch.device(device), dtype
        self.weights = DecodeWeights(source_model, self.device, dtype, self.tp, sync)
        self.shape = self.weights.shape
        self.max_length = max_length
        cos, sin = rotary_table(source_model, max_length, self.device, dtype)
        if decode_attention == "auto":
            # flex attention is fast only as compiled code: the compiled step on CUDA (CPU runs eagerly)
            decode_attention = "flex" if compile_decode and self.device.type == "cuda" else "sdpa"
        self.forward = DecoderForward(self.weights, cos, sin, decode_attention, flex_kernel_options)
        if compile_decode:
            self._decode_and_sample = torch.compile(self._forward_and_sample, dynamic=False, mode=compile_mode)
        else:
            self._decode_and_sample = self._forward_and_sample
        self.use_graphs = self.device.type == "cuda" if use_cuda_graphs is None else use_cuda_graphs
        self.check_every = check_every
        self.prefill_tokens = prefill_tokens
        self.cache: KVCache | None = None
        self.state: _DecodeState | None = None
        self.graphs: dict = {}
        self.graph_pool = None
        self.capture_s = 0.0

    def sync_weights(self, source_model) -> None:
        self.weights.sync_from(source_model)

    # ------------------------------------------------------------------ buffers and graphs

    def _ensure_buffers(self, slots: int, length: int, max_new_tokens: int, pad_id: int, eos_ids: list[int]):
        """Reuse the cache and graphs when the request fits them; otherwise grow (and recapture)."""
        fits = (self.cache is not None and self.cache.slots == slots and self.cache.max_length >= length
                and self.state.out_tokens.shape[1] == max_new_tokens and self.state.pad_id == pad_id
                and self.state.eos.tolist() == (eos_ids or [-1]))
        if fits:
            return
        self.graphs.clear()
        # a fresh pool for the new graphs: capturing into the old one, whose graphs are gone, trips
        # an internal assert of the CUDA caching allocator (torch 2.11, H200)
        self.graph_pool = None
        self.cache = self.state = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.cache = KVCache(self.weights.local_shape, slots, length, self.device, self.dtype)
        self.state = _DecodeState(slots, max_new_tokens, self.device, pad_id, eos_ids)

    def _forward_and_sample(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                            mode: SamplingMode, uniform: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return sample_tokens(self.forward.decode(tokens, positions, cache), mode, uniform)

    def _step(self, mode: SamplingMode, keyed: bool = False) -> None:
        """One decode step on the static buffers: forward, sample, record, advance."""
        st = self.state
        # the draws are made here, outside the compiled region: the native rand is safe to capture
        # in the CUDA graph, a random op inside an inductor graph may replay the same numbers
        uniform = st.draws(slice(None), mode, keyed)
        tokens, logprobs = self._decode_and_sample(st.tokens, st.positions, self.cache, mode, uniform)
        tokens = torch.where(st.done, st.pad_id, tokens)
        st.out_tokens.index_copy_(1, st.step, tokens[:, None])
        st.out_logprobs.index_copy_(1, st.step, logprobs[:, None])
        st.done |= torch.isin(tokens, st.eos)
        st.tokens.copy_(tokens)
        st.positions.add_(1).clamp_(max=self.cache.max_length - 1)
        st.step.add_(1)

    def _runner(self, mode: SamplingMode, keyed: bool = False):
        if not self.use_graphs:
            return lambda: self._step(mode, keyed)
        key = (mode, keyed and not mode.greedy)  # keyed or torch.rand draws: two computations
        if key not in self.graphs:
            self.graphs[key] = self._capture(mode, keyed)
        return self.graphs[key].replay

    @contextmanager
    def _state_restored(self):
        """Undo, on exit, what decode steps run inside wrote to the state buffers (not the cache)."""
        saved = [t.clone() for t in self.state.written()]
        try:
            yield
        finally:
            for buffer, value in zip(self.state.written(), saved):
                buffer.copy_(value)

    def _warm_up(self, mode: SamplingMode, keyed: bool = False) -> None:
        """Two decode steps before a capture (compilation, allocator, kernel plans).

        Run inside `_state_restored`, after the state is set for a generation and before its
        prefill: its key/value writes land at each slot's first decode position and the one after,
        which no step has read yet and the prefill or the real steps overwrite before reading them
        (a step writes its position, then attends to it).
        """
        for _ in range(2):
            self._step(mode, keyed)
            self.state.step.zero_()  # keeps the next step's output column in range

    def _capture(self, mode: SamplingMode, keyed: bool) -> torch.cuda.CUDAGraph:
        """Capture one decode step, leaving the state as it found it (set for the generation)."""
        start = time.perf_counter()
        with self._state_restored():
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._warm_up(mode, keyed)
            torch.cuda.current_stream().wait_stream(stream)
            if self.graph_pool is None:
                self.graph_pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.graph_pool):
                self._step(mode, keyed)
        torch.cuda.synchronize()
        self.capture_s += time.perf_counter() - start
        return graph

    # ------------------------------------------------------------------ generation

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, mode: SamplingMode,
                 eos_ids: list[int], pad_id: int, stop_check=None, ignore_eos: bool = False,
                 seed: int | None = None, sample_ids: list[int] | None = None) -> Generation:
        """Sample up to max_new_tokens after each prompt.

        stop_check(index, tokens) -> int | None: the response length at which a stop string ends
        sequence `index` (checked on the host every `check_every` steps and at the end).
        seed: keyed draws, `keyed_uniform(seed, sample id, response position)` (int64 seed), so a
        sample's tokens depend on its id, not on its batch or slot; None: torch.rand draws, except
        under tensor parallelism, where a seed from rank 0 (`TensorParallel.shared_seed`) keeps the
        ranks' draws alike. sample_ids: one per prompt (default 0..n-1), unique within a request.
        """
        if seed is None and self.tp is not None and not mode.greedy:
            seed = self.tp.shared_seed(self.device)
        keyed = seed is not None
        count = len(prompts)
        if sample_ids is not None and len(sample_ids) != count:
            raise ValueError(f"{len(sample_ids)} sample ids for {count} prompts")
        longest = max(len(p) for p in prompts)
        length = round_up(longest + max_new_tokens, 64)
        if length > self.max_length:
            raise ValueError(f"prompt ({longest}) + max_new_tokens ({max_new_tokens}) exceeds the engine's "
                             f"max_length {self.max_length}")
        slots = batch_bucket(count) if self.use_graphs else count
        self._ensure_buffers(slots, length, max_new_tokens, pad_id, [] if ignore_eos else eos_ids)
        st = self.state
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        st.done.fill_(True)
        st.done[:count] = False
        st.step.zero_()
        st.out_tokens.fill_(pad_id)
        st.positions.zero_()
        st.positions[:count] = lengths
        st.tokens.fill_(pad_id)
        if keyed:
            st.seed.fill_(seed)
            st.sample_ids.zero_()
            st.sample_ids[:count] = torch.tensor(sample_ids if sample_ids is not None else range(count))
        capture_before = self.capture_s
        run_step = self._runner(mode, keyed)  # captured, when new, before prefill
        start = time.perf_counter()
        # prefill in row chunks so activations stay bounded for long prompts
        rows = max(1, self.prefill_tokens // max(longest, 1))
        for first in range(0, count, rows):
            chunk = prompts[first:first + rows]
            width = max(len(p) for p in chunk)
            ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
            for i, p in enumerate(chunk):
                ids[i, :len(p)] = torch.tensor(p, dtype=torch.long)
            logits = self.forward.prefill(ids.to(self.device), lengths[first:first + len(chunk)], self.cache, first)
            tokens, logprobs = sample_tokens(logits, mode, st.draws(slice(first, first + len(chunk)), mode, keyed))
            st.out_tokens[first:first + len(chunk), 0] = tokens
            st.out_logprobs[first:first + len(chunk), 0] = logprobs
            st.tokens[first:first + len(chunk)] = tokens
        st.done[:count] |= torch.isin(st.tokens[:count], st.eos)
        st.step.fill_(1)
        self._sync()
        prefill_s = time.perf_counter() - start

        start = time.perf_counter()
        stopped_at: dict[int, int] = {}
        settled: set[int] = set()  # sequences ended by eos whose text the stop strings have seen
        for step in range(1, max_new_tokens):
            run_step()
            if step % self.check_every == 0 or step == max_new_tokens - 1:
                if stop_check is not None:
                    self._apply_stop_strings(stop_check, count, step + 1, stopped_at, settled)
                if bool(st.done[:count].all()):
                    break
        self._sync()
        timings = {"prefill_s": prefill_s, "capture_s": self.capture_s - capture_before,
                   "decode_s": time.perf_counter() - start}
        return self._collect(count, max_new_tokens, eos_ids, ignore_eos, stopped_at, timings)

    def _apply_stop_strings(self, stop_check, count: int, produced: int, stopped_at: dict[int, int],
                            settled: set[int]) -> None:
        """Cut each sequence at its first stop string. One that reached eos since the last check is
        checked once more, on its text before the eos (a stop string before the eos still cuts)."""
        done = self.state.done[:count].tolist()
        rows = self.state.out_tokens[:count, :produced].tolist()
        eos = set(self.state.eos.tolist())
        newly = []
        for i, (is_done, row) in enumerate(zip(done, rows)):
            if i in stopped_at or i in settled:
                continue
            if is_done:
                settled.add(i)
                row = row[:next((j for j, token in enumerate(row) if token in eos), len(row))]
            cut = stop_check(i, row)
            if cut is not None:
                stopped_at[i] = cut
                if not is_done:
                    newly.append(i)
        if newly:
            self.state.done[torch.tensor(newly, device=self.device)] = True

    def _collect(self, count, max_new_tokens, eos_ids, ignore_eos, stopped_at, timings) -> Generation:
        tokens = self.state.out_tokens[:count].tolist()
        logprobs = self.state.out_logprobs[:count].tolist()
        eos = set() if ignore_eos else set(eos_ids)
        out = Generation([], [], [], timings)
        for i, row in enumerate(tokens):
            cut = next((j + 1 for j, t in enumerate(row) if t in eos), None)
            if i in stopped_at and (cut is None or stopped_at[i] < cut):
                cut = stopped_at[i]
            stopped = cut is not None
            cut = cut or max_new_tokens
            out.tokens.append(row[:cut])
            out.logprobs.append(logprobs[i][:cut])
            out.stopped.append(stopped)
        return out

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
