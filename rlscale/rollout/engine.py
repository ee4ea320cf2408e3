"""The rollout engine: batched prefill, a paged KV cache, decode steps replayed as CUDA graphs.

    engine = RolloutEngine(policy_model, device, dtype)
    engine.sync_weights(policy_model)           # after every update; copies in place, no disk
    out = engine.generate(prompt_ids, max_new_tokens=256, mode=SamplingMode(1.0), eos_ids=[eos])

A compiled decode step on CUDA attends through flex attention with a block mask of each
sequence's own cache blocks, built on the device every step, so one graph serves every length.
On CUDA each (batch bucket, sampling mode) gets one captured graph: the whole batch's before the
prefill of the first generation that needs it, a smaller bucket's at its first use; the host loop
replays them and, when sequences running into their length caps free a slot a waiting prompt can
take or let the rest fit a smaller batch, reads back which sequences have stopped; every
`check_every` steps it reads the live count and does the same only where ends (eos) pay. With
`compile_decode` the step (forward and sampling) is compiled whole before capture. On CPU the
same step runs eagerly (the path the tests exercise).

Paged cache, admission, preemption, a shrinking batch: the KV cache is a pool of blocks of
`block_size` positions (`forward.KVCache`; `blocks.BlockPool` keeps which blocks each slot's
sequence holds, mirrored on the device as the slots' block table). A sequence takes blocks as it
grows, at each host check those it writes into before the next one, and gives them all back when
it ends. `kv_budget_bytes` sizes the pool (without one: every sequence's full length at once). A
generation with more prompts than fit admits them as blocks free up: at each host check a
finished sequence's slot and blocks are freed and the next waiting prompts are prefilled into
free slots while the pool has blocks for them (one `Generation.waves` each round). When the live
sequences outgrow the pool, the newest is preempted: its blocks freed, its sample back at the
head of the queue, prefilled again later from its prompt (`Generation.preemptions`; greedy and
keyed draws give it the same tokens). Once none waits, the live sequences are compacted into the
lowest slots (state rows and block table rows; the blocks stay put) and a step runs over the
first `rows` slots only: the smallest batch bucket holding them (eagerly, exactly them), so step
cost follows the sequences still running (`Generation.decode_batches`). With torch.rand draws (no
seed) sequences are not moved, since a slot's draws would change.

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
from collections import Counter, deque
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from rlscale.rollout.blocks import BlockPool
from rlscale.rollout.forward import FLEX_KV_BLOCK, DecoderForward, KVCache, rotary_table
from rlscale.rollout.sampling import SamplingMode, keyed_uniform, sample_tokens, uniform_draws
from rlscale.rollout.stops import is_stop, stop_table
from rlscale.rollout.tensor_parallel import TensorParallel
from rlscale.rollout.weights import DecodeWeights, unsupported_reason


@dataclass
class Generation:
    """Per sequence: sampled tokens (through the first eos/stop), their logprobs, how it ended."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    stopped: list[bool]  # ended by eos or a stop string (False: ran into max_new_tokens)
    timings: dict[str, float] = field(default_factory=dict)
    # admission rounds (1: every prompt prefilled at the start; more under a KV budget that holds
    # fewer sequences than prompts) and the batch each decode step ran at (shrinks as sequences end)
    waves: int = 1
    decode_batches: list[int] = field(default_factory=list)
    # sequences sent back to wait (their blocks freed) when the pool ran out, and the most cache
    # blocks held at once
    preemptions: int = 0
    peak_blocks: int = 0
    shared_prefills: int = 0  # samples admitted on another sample's prefill of their prompt (no prefill of their own)
    host_checks: int = 0  # decode-loop host checks (each one a device sync)


def batch_bucket(size: int) -> int:
    """Graphs are captured for a few batch sizes; a batch runs in the smallest that fits."""
    bucket = 8
    while bucket < size:
        bucket *= 2
    return bucket


def bucket_below(size: int) -> int:
    """The largest bucket smaller than batch_bucket(size) (0: none, it is the smallest)."""
    bucket = batch_bucket(size)
    return bucket // 2 if bucket > batch_bucket(1) else 0


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class _DecodeState:
    """Static buffers a captured decode step reads and writes (addresses never change)."""

    def __init__(self, slots: int, max_new_tokens: int, device, pad_id: int, eos_ids: list[int], blocks: int,
                 scratch: int):
        # each slot's cache blocks in order (its `BlockPool.table` row; `scratch` where it has none)
        self.scratch = scratch
        self.block_table = torch.full((slots, blocks), scratch, dtype=torch.long, device=device)
        self.tokens = torch.full((slots,), pad_id, dtype=torch.long, device=device)
        self.positions = torch.zeros(slots, dtype=torch.long, device=device)
        self.done = torch.ones(slots, dtype=torch.bool, device=device)
        # each slot's response position: sequences admitted later (a KV budget) are behind the others
        self.step = torch.zeros(slots, dtype=torch.long, device=device)
        # each slot's response length cap (max_new_tokens, or the sample's own `length_caps` entry)
        self.limit = torch.full((slots,), max_new_tokens, dtype=torch.long, device=device)
        # one column past max_new_tokens: where a finished slot's step writes (never read)
        self.max_new_tokens = max_new_tokens
        self.out_tokens = torch.full((slots, max_new_tokens + 1), pad_id, dtype=torch.long, device=device)
        self.out_logprobs = torch.zeros(slots, max_new_tokens + 1, dtype=torch.float32, device=device)
        self.eos = torch.tensor(eos_ids or [-1], dtype=torch.long, device=device)
        self.stop_table = stop_table(eos_ids, device)  # [max id + 2] bool: `is_stop` gathers, any stop set size
        self.pad_id = pad_id
        # keyed draws: read by the step, set per generation (sample ids of padding slots unused)
        self.seed = torch.zeros(1, dtype=torch.long, device=device)
        self.sample_ids = torch.zeros(slots, dtype=torch.long, device=device)

    def draws(self, rows: slice | torch.Tensor, mode: SamplingMode, keyed: bool,
              every_slot: bool = False) -> torch.Tensor | None:
        """The uniform draws for slots `rows`' tokens at their response positions `step` (None: greedy).
        every_slot (a decode step's torch.rand draws): one draw per slot of the cache, `rows`' taken,
        so a slot's draw does not depend on how many slots the step runs."""
        if mode.greedy:
            return None
        ids = self.sample_ids[rows]
        if keyed:
            return keyed_uniform(self.seed, ids, self.step[rows])
        if every_slot:
            return uniform_draws(len(self.sample_ids), ids.device)[rows]
        return uniform_draws(len(ids), ids.device)

    def written(self) -> list[torch.Tensor]:
        """The buffers a decode step writes (besides the KV cache)."""
        return [self.tokens, self.positions, self.done, self.step, self.out_tokens, self.out_logprobs]

    def per_slot(self) -> list[torch.Tensor]:
        """The buffers with one row per slot: what compaction moves with a slot's KV rows."""
        return self.written() + [self.sample_ids, self.limit, self.block_table]


class _Run:
    """One generation's host bookkeeping: waiting prompts, finished rows, stop-string state."""

    def __init__(self, prompts: list[list[int]], sample_ids: list[int], max_new_tokens: int, prefill_rows: int,
                 caps: list[int]):
        self.prompts, self.sample_ids, self.max_new_tokens = prompts, sample_ids, max_new_tokens
        self.caps = caps  # per sample: the response length it may reach (at most max_new_tokens)
        self.prefill_rows = prefill_rows
        self.waiting = deque(range(len(prompts)))
        self.tokens: list[list[int] | None] = [None] * len(prompts)
        self.logprobs: list[list[float] | None] = [None] * len(prompts)
        self.stopped_at: dict[int, int] = {}  # sample -> response length its stop string ends it at
        self.settled: set[int] = set()  # samples ended by eos whose text the stop strings have seen
        self.admitted_at: dict[int, int] = {}  # slot -> decode steps run before its sample's prefill
        self.steps, self.waves, self.prefill_s, self.preemptions, self.checks = 0, 0, 0.0, 0, 0
        self.decode_batches: list[int] = []
        # prompt sharing: each sample's prompt key, how many samples of each prompt still wait, and
        # the logits at a prompt's last token while some do (its sharers sample their first token there)
        self.keys = [tuple(p) for p in prompts]
        self.pending = Counter(self.keys)
        self.first_logits: dict[tuple, torch.Tensor] = {}
        self.shared_prefills = 0

    def next_deadline(self, slot_sample: list[int | None], follows: str) -> int:
        """The step count at which a check before the next `check_every` pays (0 when none is
        live). Each check syncs the device and idles it while the host works, so one per ended
        sequence would cost a long tail more than the smaller batch saves. With prompts waiting:
        the first live sequence to run into its length cap (its slot takes one). Otherwise by
        how the decode batch follows the live ones (`follows`): "each_end", it may shrink at any end
        (eager, or slots not compacted): the first end; "buckets", compacted into batch_bucket
        sizes: the end after which the rest fit the next size down; "whole", it never shrinks:
        the last end."""
        ends = sorted(self.admitted_at[s] + self.caps[i] - 1 for s, i in enumerate(slot_sample) if i is not None)
        if not ends:
            return 0
        if self.waiting or follows == "each_end":
            return ends[0]
        if follows == "whole":
            return ends[-1]
        return ends[len(ends) - bucket_below(len(ends)) - 1]  # once that many have ended


class RolloutEngine:
    def __init__(self, source_model, device: torch.device, dtype: torch.dtype, max_length: int = 2048,
                 use_cuda_graphs: bool | None = None, check_every: int = 16, prefill_tokens: int = 16384,
                 compile_decode: bool = False, decode_attention: str = "auto", compile_mode: str | None = None,
                 flex_kernel_options: dict | None = None, tp: TensorParallel | None = None, sync: bool = True,
                 kv_budget_bytes: int | None = None, shrink_batch: bool = True, block_size: int = FLEX_KV_BLOCK,
                 share_prompts: bool = True):
        """tp: this rank's place in a tensor-parallel group (None, or size 1: one device holds the
        whole model). sync=False: the weights are left unfilled, for a streamed first sync through
        `weights.copy_named` before the first generation. kv_budget_bytes: the most bytes the KV
        cache may take (this rank's, its own kv heads under tp); a generation with more prompts than
        `slot_capacity` admits them as others finish (None: one slot per prompt, all at once).
        block_size: cache positions per block of the paged cache (flex attention's block size).
        shrink_batch=False: every decode step runs over the whole cache until the last sequence
        ends (no compaction; the engine before the shrinking batch, kept as a benchmark baseline).
        share_prompts: samples with one prompt (a GRPO group) prefill it once; the others hold its
        whole cache blocks too, copy its last partial block and sample their first token from its
        logits (with their own draws)."""
        reason = unsupported_reason(source_model.config, max_length)
        if reason:
            raise ValueError(f"rollout engine does not support {reason}")
        self.tp = tp if tp is not None and (tp.size > 1 or tp.communicate_alone) else None
        if self.tp is not None and not self.tp.capturable():
            if use_cuda_graphs or compile_decode:
                warnings.warn("rollout engine: CUDA graphs and compile are off under a non-NCCL tensor-parallel "
                              "group (its collectives cannot be captured)", stacklevel=2)
            use_cuda_graphs, compile_decode = False, False
        self.device, self.dtype = torch.device(device), dtype
        self.weights = DecodeWeights(source_model, self.device, dtype, self.tp, sync)
        self.shape = self.weights.shape
        self.max_length = max_length
        # a row for every position a block table of max_length addresses: a finished slot runs on
        # (its outputs discarded) up to its table's last position, past max_length when block_size
        # does not divide it (a CUDA graph's batch bucket steps freed slots through a whole wave)
        cos, sin = rotary_table(source_model, max_length, self.device, dtype, rows=round_up(max_length, block_size))
        if decode_attention == "auto":
            # flex attention is fast only as compiled code: the compiled step on CUDA (CPU runs eagerly)
            decode_attention = "flex" if compile_decode and self.device.type == "cuda" else "sdpa"
        self.forward = DecoderForward(self.weights, cos, sin, decode_attention, flex_kernel_options)
        if compile_decode:
            self._decode_and_sample = torch.compile(self._forward_and_sample, dynamic=False, mode=compile_mode)
        else:
            self._decode_and_sample = self._forward_and_sample
        self.use_graphs = self.device.type == "cuda" if use_cuda_graphs is None else use_cuda_graphs
        self.compiled = compile_decode
        self.check_every = check_every
        self.prefill_tokens = prefill_tokens
        self.cache: KVCache | None = None
        self.state: _DecodeState | None = None
        self.graphs: dict = {}
        self.graph_pool = None
        self.capture_s = 0.0
        self.kv_budget_bytes = kv_budget_bytes
        self.slot_sample: list[int | None] = []  # the sample each cache slot holds (None: free)
        self.shrink_batch = shrink_batch
        self.share_prompts = share_prompts
        self.block_size = block_size
        self.pool: BlockPool | None = None
        self.block_logical: torch.Tensor | None = None  # [pool blocks + 1]: each block's index in its table
        # (slot, logical index, physical block) taken on the host, not yet mirrored on the device:
        # pushed in one copy per host check (one per slot cost ~12% of a decode at 256 sequences)
        self._taken: list[tuple[int, int, int]] = []

    def sync_weights(self, source_model) -> None:
        self.weights.sync_from(source_model)

    def block_bytes(self) -> int:
        """One cache block's bytes (this rank's kv heads, every layer, keys and values)."""
        return KVCache.sequence_bytes(self.weights.local_shape, self.block_size, self.dtype)

    def slot_bytes(self, length: int) -> int:
        """The KV cache bytes of one sequence of `length` positions, in whole blocks."""
        return -(-length // self.block_size) * self.block_bytes()

    def budget_blocks(self) -> int | None:
        """The blocks the KV budget holds besides the scratch block (None: no budget)."""
        if self.kv_budget_bytes is None:
            return None
        return self.kv_budget_bytes // self.block_bytes() - 1

    def slot_capacity(self, length: int) -> int | None:
        """How many sequences of `length` cache positions the KV budget holds at once, each grown to
        its full length (None: no budget). Shorter ones hold fewer blocks, so more run at once."""
        if self.kv_budget_bytes is None:
            return None
        blocks = self.budget_blocks() // -(-length // self.block_size)
        if blocks < 1:
            raise ValueError(f"the rollout engine's KV budget of {self.kv_budget_bytes} bytes holds no sequence of "
                             f"{length} positions (one takes {self.slot_bytes(length)} bytes and the scratch block "
                             f"{self.block_bytes()})")
        return blocks

    # ------------------------------------------------------------------ buffers and graphs

    def _ensure_buffers(self, slots: int, blocks: int, table_width: int, max_new_tokens: int, pad_id: int,
                        eos_ids: list[int]):
        """Reuse the cache and graphs when the request fits them; otherwise remake (and recapture).
        slots: sequences decoding at once; blocks: the pool; table_width: blocks per sequence."""
        fits = (self.cache is not None and self.cache.num_blocks == blocks and len(self.slot_sample) == slots
                and self.state.block_table.shape[1] == table_width
                and self.state.max_new_tokens == max_new_tokens and self.state.pad_id == pad_id
                and self.state.eos.tolist() == (eos_ids or [-1]))
        if fits:
            self.pool = BlockPool(blocks, self.block_size, slots)
            return
        self.graphs.clear()
        # a fresh pool for the new graphs: capturing into the old one, whose graphs are gone, trips
        # an internal assert of the CUDA caching allocator (torch 2.11, H200)
        self.graph_pool = None
        self.cache = self.state = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.cache = KVCache(self.weights.local_shape, blocks, self.block_size, self.device, self.dtype)
        self.pool = BlockPool(blocks, self.block_size, slots)
        self.state = _DecodeState(slots, max_new_tokens, self.device, pad_id, eos_ids, table_width, self.pool.scratch)
        self.block_logical = torch.zeros(blocks + 1, dtype=torch.long, device=self.device)
        self.slot_sample = [None] * slots

    def _forward_and_sample(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                            block_table: torch.Tensor, block_logical: torch.Tensor, mode: SamplingMode,
                            uniform: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return sample_tokens(self.forward.decode(tokens, positions, cache, block_table, block_logical), mode, uniform)

    def _step(self, mode: SamplingMode, keyed: bool = False, rows: int | None = None) -> None:
        """One decode step on the static buffers' first `rows` slots (None: all): forward, sample,
        record, advance. A finished slot samples padding into the spare last output column."""
        st = self.state
        batch = slice(0, rows)
        done, step = st.done[batch], st.step[batch]
        # the draws are made here, outside the compiled region: the native rand is safe to capture
        # in the CUDA graph, a random op inside an inductor graph may replay the same numbers
        uniform = st.draws(batch, mode, keyed, every_slot=True)
        tokens, logprobs = self._decode_and_sample(st.tokens[batch], st.positions[batch], self.cache,
                                                   st.block_table[batch], self.block_logical, mode, uniform)
        tokens = torch.where(done, st.pad_id, tokens)
        column = torch.where(done, st.max_new_tokens, step)[:, None]
        st.out_tokens[batch].scatter_(1, column, tokens[:, None])
        st.out_logprobs[batch].scatter_(1, column, logprobs[:, None])
        st.done[batch] |= is_stop(st.stop_table, tokens)
        st.tokens[batch].copy_(tokens)
        # a finished slot runs on past its blocks: those positions map to the scratch block
        st.positions[batch].add_(1).clamp_(max=st.block_table.shape[1] * self.block_size - 1)
        step.add_(1)
        done |= step >= st.limit[batch]  # ran into its length cap: the slot is free from here

    def _runner(self, mode: SamplingMode, keyed: bool = False):
        """run(rows): one decode step over the first `rows` slots (a batch bucket under CUDA graphs:
        each bucket's graph is captured at its first use, the whole cache's before this returns)."""
        if not self.use_graphs:
            return lambda rows=None: self._step(mode, keyed, rows)
        keyed = keyed and not mode.greedy  # keyed or torch.rand draws: two computations

        def graph(rows: int) -> torch.cuda.CUDAGraph:
            key = (mode, keyed, rows)
            if key not in self.graphs:
                self.graphs[key] = self._capture(mode, keyed, rows)
            return self.graphs[key]

        slots = len(self.slot_sample)
        graph(slots)
        return lambda rows=None: graph(rows or slots).replay()

    @contextmanager
    def _state_restored(self):
        """Undo, on exit, what decode steps run inside wrote to the state buffers (not the cache)."""
        saved = [t.clone() for t in self.state.written()]
        try:
            yield
        finally:
            for buffer, value in zip(self.state.written(), saved):
                buffer.copy_(value)

    def _warm_up(self, mode: SamplingMode, keyed: bool = False, rows: int | None = None) -> None:
        """Two decode steps before a capture (compilation, allocator, kernel plans).

        Run inside `_state_restored`, after the state is set for a generation (before its prefill,
        or between two steps when a smaller batch bucket is first used): its key/value writes land
        at each slot's next decode position and the one after, which no step has read yet and the
        prefill or the real steps overwrite before reading them (a step writes its position, then
        attends to it).
        """
        for _ in range(2):
            self._step(mode, keyed, rows)
            self.state.step.zero_()  # keeps the next step's output column in range

    def _capture(self, mode: SamplingMode, keyed: bool, rows: int | None = None) -> torch.cuda.CUDAGraph:
        """Capture one decode step over `rows` slots, leaving the state as it found it."""
        start = time.perf_counter()
        with self._state_restored():
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._warm_up(mode, keyed, rows)
            torch.cuda.current_stream().wait_stream(stream)
            if self.graph_pool is None:
                self.graph_pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.graph_pool):
                self._step(mode, keyed, rows)
        torch.cuda.synchronize()
        self.capture_s += time.perf_counter() - start
        return graph

    # ------------------------------------------------------------------ generation

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, mode: SamplingMode,
                 eos_ids: list[int], pad_id: int, stop_check=None, ignore_eos: bool = False,
                 seed: int | None = None, sample_ids: list[int] | None = None,
                 length_caps: list[int] | None = None) -> Generation:
        """Sample up to max_new_tokens after each prompt.

        stop_check(index, tokens) -> int | None: the response length at which a stop string ends
        sequence `index` (checked on the host every `check_every` steps and at the end).
        seed: keyed draws, `keyed_uniform(seed, sample id, response position)` (int64 seed), so a
        sample's tokens depend on its id, not on its batch or slot; None: torch.rand draws, except
        under tensor parallelism, where a seed from rank 0 (`TensorParallel.shared_seed`) keeps the
        ranks' draws alike. sample_ids: one per prompt (default 0..n-1), unique within a request.
        length_caps: one per prompt, the response length (1..max_new_tokens) at which that sequence
        ends as if it ran into max_new_tokens (benchmarks force long-tailed lengths with it).

        Under a KV budget (`kv_budget_bytes`) at most `slot_capacity` sequences live at once: the
        first prompts fill the slots, and at each host check a finished sequence's slot takes the
        next waiting prompt (prefilled into it, `Generation.waves` counts these rounds). Once none
        waits, the live sequences are compacted into the lowest slots and each step runs over the
        smallest batch (bucket, under CUDA graphs) holding them (`Generation.decode_batches`). A
        sample's tokens depend on neither its slot nor its wave: positions and draws are its own.
        """
        if seed is None and self.tp is not None and not mode.greedy:
            seed = self.tp.shared_seed(self.device)
        keyed = seed is not None
        count = len(prompts)
        if sample_ids is not None and len(sample_ids) != count:
            raise ValueError(f"{len(sample_ids)} sample ids for {count} prompts")
        caps = [max_new_tokens] * count if length_caps is None else list(length_caps)
        if len(caps) != count or not all(1 <= c <= max_new_tokens for c in caps):
            raise ValueError(f"length_caps: one per prompt, each 1..max_new_tokens ({max_new_tokens})")
        longest = max(len(p) for p in prompts)
        length = round_up(longest + max_new_tokens, 64)
        if length > self.max_length:
            raise ValueError(f"prompt ({longest}) + max_new_tokens ({max_new_tokens}) exceeds the engine's "
                             f"max_length {self.max_length}")
        width = -(-length // self.block_size)  # blocks of the longest sequence
        self.slot_capacity(longest + max_new_tokens)  # a budget that cannot hold the longest sequence is refused
        blocks = self.budget_blocks()
        if blocks is None:  # no budget: every sequence at once, each its full length
            at_once = count
        else:  # at most as many as the pool holds at their first blocks (admission takes fewer)
            first = -(-(min(len(p) for p in prompts) + min(self.check_every, max_new_tokens)) // self.block_size)
            at_once = min(count, max(1, blocks // first))
        slots = batch_bucket(at_once) if self.use_graphs else at_once
        self._ensure_buffers(slots, slots * width if blocks is None else blocks, width, max_new_tokens, pad_id,
                             [] if ignore_eos else eos_ids)
        st = self.state
        st.block_table.fill_(self.pool.scratch)
        st.done.fill_(True)
        st.step.zero_()
        st.out_tokens.fill_(pad_id)
        st.positions.zero_()
        st.tokens.fill_(pad_id)
        st.sample_ids.zero_()
        if keyed:
            st.seed.fill_(seed)
        self.slot_sample = [None] * slots
        capture_before = self.capture_s
        run_step = self._runner(mode, keyed)  # the whole cache's graph captured, when new, before prefill
        run = _Run(prompts, list(sample_ids) if sample_ids is not None else list(range(count)), max_new_tokens,
                   max(1, self.prefill_tokens // max(longest, 1)), caps)
        start, capture_start = time.perf_counter(), self.capture_s
        # how the decode batch follows the live sequences (_decode_rows; _refresh compacts only
        # keyed or greedy runs: torch.rand draws belong to slots)
        compacted_buckets = (keyed or mode.greedy) and (self.use_graphs or self.compiled)
        follows = "whole" if not self.shrink_batch else "buckets" if compacted_buckets else "each_end"
        self._refresh(run, mode, keyed, stop_check)
        deadline = run.next_deadline(self.slot_sample, follows)
        while any(i is not None for i in self.slot_sample):
            rows = self._decode_rows()
            run_step(rows)
            run.steps += 1
            run.decode_batches.append(rows or slots)
            if run.steps >= deadline or (run.steps % self.check_every == 0
                                         and self._check_pays(run, follows, rows, stop_check)):
                self._refresh(run, mode, keyed, stop_check)
                run.checks += 1
                deadline = run.next_deadline(self.slot_sample, follows)
        self._sync()
        elapsed = time.perf_counter() - start
        timings = {"prefill_s": run.prefill_s, "capture_s": self.capture_s - capture_before,
                   "decode_s": elapsed - run.prefill_s - (self.capture_s - capture_start)}
        out = self._collect(run, eos_ids, ignore_eos, timings)
        out.waves, out.decode_batches, out.preemptions = run.waves, run.decode_batches, run.preemptions
        out.shared_prefills, out.host_checks = run.shared_prefills, run.checks
        out.peak_blocks = self.pool.peak_used
        return out

    def _decode_rows(self) -> int | None:
        """The batch a decode step runs at: the smallest bucket (eagerly: exactly) holding every
        live slot (None: the whole cache)."""
        if not self.shrink_batch:
            return None
        top = max(s for s, i in enumerate(self.slot_sample) if i is not None) + 1
        # buckets under graphs (one capture each) and compile (one compiled shape each, well inside
        # dynamo's recompile limit); eagerly the exact count
        slots = len(self.slot_sample)
        rows = min(batch_bucket(top), slots) if self.use_graphs or self.compiled else top
        return None if rows == slots else rows

    def _refresh(self, run: _Run, mode: SamplingMode, keyed: bool, stop_check) -> None:
        """A host check: stop strings, finished sequences out (their slots and blocks freed), the
        live ones given blocks up to the next check, waiting prompts into the lowest free slots
        while the pool has blocks for them, and, once none waits, compaction of the live ones."""
        while True:  # a prompt may end at prefill (eos, or max_new_tokens 1): its slot is free again
            if stop_check is not None:
                self._apply_stop_strings(stop_check, run)
            positions = self._harvest(run)
            self._grow(run, positions)
            free = [s for s, i in enumerate(self.slot_sample) if i is None]
            if not (run.waiting and free) or not self._admit(run, free[:len(run.waiting)], mode, keyed):
                break
        # torch.rand draws go to slots: moving a sample would change its draws (keyed ones go with it)
        if self.shrink_batch and not run.waiting and (keyed or mode.greedy):
            self._compact(run)

    def _check_pays(self, run: _Run, follows: str, rows: int | None, stop_check) -> bool:
        """At a periodic check: does a full one (harvest, stop strings, admission, compaction) pay?
        With nothing waiting and no stop strings it pays only once enough sequences have ended to
        shrink the batch (or all have): that reads one number, the live count, so the device idles
        for a launch rather than for the host's bookkeeping. Otherwise the live sequences get their
        blocks up to the next check from positions the host knows (a live sequence advances one per
        step since its admission); a pool too short for them needs the full check (preemption,
        from positions read on the device)."""
        if run.waiting or stop_check is not None:
            return True
        live_slots = {s: i for s, i in enumerate(self.slot_sample) if i is not None}
        still = int((~self.state.done).sum())  # the one device read
        if still == 0 or (follows == "each_end" and still < len(live_slots)):
            return True
        if follows == "buckets" and batch_bucket(still) < (rows or len(self.slot_sample)):
            return True
        positions = {s: len(run.prompts[i]) + run.steps - run.admitted_at[s] for s, i in live_slots.items()}
        return not self._grow(run, positions, preempt=False)

    def _harvest(self, run: _Run) -> dict[int, int]:
        """Copy the finished sequences' rows to the host and free their slots; returns the live
        ones' positions (read with the finished flags: one device read per check)."""
        live = [s for s, i in enumerate(self.slot_sample) if i is not None]
        if not live:
            return {}
        at = torch.tensor(live, device=self.device)
        done, positions = torch.stack([self.state.done[at].long(), self.state.positions[at]]).tolist()
        finished = [s for s, d in zip(live, done) if d]
        if finished:
            at = torch.tensor(finished, device=self.device)
            tokens = self.state.out_tokens[at, :run.max_new_tokens].tolist()
            logprobs = self.state.out_logprobs[at, :run.max_new_tokens].tolist()
            for s, row, lp in zip(finished, tokens, logprobs):
                run.tokens[self.slot_sample[s]], run.logprobs[self.slot_sample[s]] = row, lp
            self._free_slots(finished)
        return {s: p for s, p, d in zip(live, positions, done) if not d}

    def _free_slots(self, slots: list[int]) -> None:
        """The slots' sequences are gone: their blocks back to the pool, their table rows to scratch."""
        gone = set(slots)
        self._taken = [t for t in self._taken if t[0] not in gone]
        for slot in slots:
            self.pool.release(slot)
            self.slot_sample[slot] = None
        at = torch.tensor(slots, device=self.device)
        self.state.block_table[at] = self.pool.scratch
        self.state.done[at] = True

    def _lookahead(self, run: _Run, sample: int, position: int) -> int:
        """Positions a sequence at `position` (its next write) needs until the next host check: at
        most check_every more steps, and never past its last token's position."""
        return min(position + self.check_every, len(run.prompts[sample]) + run.caps[sample])

    def _take_blocks(self, slot: int, new: list[tuple[int, int]]) -> None:
        """Note blocks the pool gave `slot` ((logical index, physical block) pairs) for the next push."""
        self._taken += [(slot, k, b) for k, b in new]

    def _push_blocks(self) -> None:
        """Mirror the blocks taken since the last push on the device, in one copy: the slots' table
        rows and each block's logical index."""
        if self._taken:
            slots, logical, physical = torch.tensor(self._taken, dtype=torch.long).T.to(self.device)
            self.state.block_table[slots, logical] = physical
            self.block_logical[physical] = logical
            self._taken = []

    def _grow(self, run: _Run, positions: dict[int, int], preempt: bool = True) -> bool:
        """Give every live sequence the blocks it writes into before the next check, oldest first.
        When the pool runs out, the newest live sequence is preempted: its blocks freed, its sample
        back at the head of the queue, to be prefilled again from its prompt (its tokens come out
        the same: greedy, or keyed draws by sample and position). preempt=False: stop there instead
        (the grants so far kept, the ones a full check would make first) and return False."""
        for s in sorted(positions, key=lambda s: (run.admitted_at[s], s)):
            while self.slot_sample[s] is not None:
                new = self.pool.grow(s, self._lookahead(run, self.slot_sample[s], positions[s]))
                if new is not None:
                    self._take_blocks(s, new)
                    break
                if not preempt:
                    self._push_blocks()
                    return False
                newest = max((t for t, i in enumerate(self.slot_sample) if i is not None),
                             key=lambda t: (run.admitted_at[t], t))
                self._preempt(run, newest)
        self._push_blocks()
        return True

    def _preempt(self, run: _Run, slot: int) -> None:
        sample = self.slot_sample[slot]
        run.waiting.appendleft(sample)
        run.pending[run.keys[sample]] += 1
        run.stopped_at.pop(sample, None)
        run.settled.discard(sample)
        run.admitted_at.pop(slot)
        run.preemptions += 1
        self._free_slots([slot])

    def _admit(self, run: _Run, targets: list[int], mode: SamplingMode, keyed: bool) -> bool:
        """Prefill the next waiting prompts into slots `targets` while the pool has blocks for
        them (in row chunks, so activations stay bounded for long prompts) and sample each one's
        first token (response position 0). A prompt that a live sequence already holds (a GRPO
        group's, `share_prompts`) is not prefilled again: the slot shares its whole blocks, copies
        its partial last block and samples from its logits. False: the pool had no blocks for the
        first of them."""
        start = time.perf_counter()
        holders = self._prompt_holders(run)
        taken, sharers = [], {}  # sharers: slot -> the slot holding its prompt's blocks
        for s in targets:  # blocks in queue order: the first that does not fit waits, and those after it
            sample = run.waiting[len(taken)]
            key = run.keys[sample]
            holder = holders.get(key)
            shared = [] if holder is None else self.pool.table[holder][:len(key) // self.block_size]
            if holder is not None:
                self._take_blocks(s, self.pool.share(s, shared))
            new = self.pool.grow(s, self._lookahead(run, sample, len(key)))
            if new is None:
                self.pool.release(s)
                self._taken = [t for t in self._taken if t[0] != s]
                break
            self._take_blocks(s, new)
            taken.append(s)
            if holder is not None:
                sharers[s] = holder
            elif self.share_prompts and run.pending[key] > 1:
                holders[key] = s  # the prompt's first sample in this round: the others share its prefill
            run.pending[key] -= 1
        if not taken:
            return False
        self._push_blocks()
        samples = {s: run.waiting.popleft() for s in taken}
        leaders = [s for s in taken if s not in sharers]
        for first in range(0, len(leaders), run.prefill_rows):
            chunk = leaders[first:first + run.prefill_rows]
            logits = self._prefill(run, chunk, [samples[s] for s in chunk])
            for row, s in enumerate(chunk):
                if run.pending[run.keys[samples[s]]] > 0 or any(h == s for h in sharers.values()):
                    run.first_logits[run.keys[samples[s]]] = logits[row].clone()  # not a view of the chunk's
            self._start(run, chunk, [samples[s] for s in chunk], logits, mode, keyed)
        if sharers:
            self._copy_partial_blocks(run, sharers, samples)
            slots = list(sharers)
            for first in range(0, len(slots), run.prefill_rows):
                chunk = slots[first:first + run.prefill_rows]
                chunk_samples = [samples[s] for s in chunk]
                logits = torch.stack([run.first_logits[run.keys[i]] for i in chunk_samples])
                self._start(run, chunk, chunk_samples, logits, mode, keyed)
            run.shared_prefills += len(sharers)
        for key in [k for k in run.first_logits if run.pending[k] == 0]:  # no sample of it waits
            del run.first_logits[key]
        run.waves += 1
        self._sync()
        run.prefill_s += time.perf_counter() - start
        return True

    def _prompt_holders(self, run: _Run) -> dict[tuple, int]:
        """For each prompt some waiting sample still needs: a live slot holding its prefilled
        blocks, whose logits at its last token are kept (`run.first_logits`)."""
        if not self.share_prompts:
            return {}
        holders = {}
        for slot, sample in enumerate(self.slot_sample):
            if sample is not None and run.pending[run.keys[sample]] > 0 and run.keys[sample] in run.first_logits:
                holders.setdefault(run.keys[sample], slot)
        return holders

    def _prefill(self, run: _Run, slots: list[int], samples: list[int]) -> torch.Tensor:
        """The prompts of `samples` into the blocks of `slots`; returns the logits at each last token."""
        chunk = [run.prompts[i] for i in samples]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), self.state.pad_id, dtype=torch.long)
        for i, p in enumerate(chunk):
            ids[i, :len(p)] = torch.tensor(p, dtype=torch.long)
        lengths = torch.tensor([len(p) for p in chunk], device=self.device)
        at = torch.tensor(slots, device=self.device)
        return self.forward.prefill(ids.to(self.device), lengths, self.cache, self.state.block_table[at])

    def _start(self, run: _Run, slots: list[int], samples: list[int], logits: torch.Tensor, mode: SamplingMode,
               keyed: bool) -> None:
        """Slots `slots` begin their samples' responses: the first token sampled from `logits` (the
        prompts' last positions), their state set for decoding."""
        st = self.state
        at = torch.tensor(slots, device=self.device)
        st.out_tokens[at] = st.pad_id
        st.positions[at] = torch.tensor([len(run.prompts[i]) for i in samples], device=self.device)
        st.step[at] = 0
        caps = torch.tensor([run.caps[i] for i in samples], device=self.device)
        st.limit[at] = caps
        st.sample_ids[at] = torch.tensor([run.sample_ids[i] for i in samples], device=self.device)
        tokens, logprobs = sample_tokens(logits, mode, st.draws(at, mode, keyed))
        st.out_tokens[at, 0] = tokens
        st.out_logprobs[at, 0] = logprobs
        st.tokens[at] = tokens
        st.step[at] = 1
        st.done[at] = is_stop(st.stop_table, tokens) | (caps <= 1)
        for s, i in zip(slots, samples):
            self.slot_sample[s] = i
            run.admitted_at[s] = run.steps

    def _copy_partial_blocks(self, run: _Run, sharers: dict[int, int], samples: dict[int, int]) -> None:
        """Each sharer's own copy of its prompt's last, partial block (the positions past the whole
        blocks it shares): decoding writes there, so it cannot be shared."""
        size = self.block_size
        src, dst = [], []
        for slot, holder in sharers.items():
            length = len(run.prompts[samples[slot]])
            whole, rest = divmod(length, size)
            if rest:
                src += range(self.pool.table[holder][whole] * size, self.pool.table[holder][whole] * size + rest)
                dst += range(self.pool.table[slot][whole] * size, self.pool.table[slot][whole] * size + rest)
        if src:
            src_at, dst_at = torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device)
            for keys, values in zip(self.cache.keys, self.cache.values):
                keys[:, dst_at] = keys[:, src_at]
                values[:, dst_at] = values[:, src_at]

    def _compact(self, run: _Run) -> None:
        """Move the live slots above the first `live` into the free ones below (state rows and
        block table rows: the blocks stay where they are), so the live sequences sit in slots
        0..live-1 and a smaller batch holds them."""
        live = sum(i is not None for i in self.slot_sample)
        holes = [s for s in range(live) if self.slot_sample[s] is None]
        if not holes:
            return
        movers = [s for s in range(live, len(self.slot_sample)) if self.slot_sample[s] is not None]
        dst, src = torch.tensor(holes, device=self.device), torch.tensor(movers, device=self.device)
        for buffer in self.state.per_slot():
            buffer[dst] = buffer[src]
        self.state.done[src] = True
        self.state.block_table[src] = self.pool.scratch
        for d, s in zip(holes, movers):
            self.slot_sample[d], self.slot_sample[s] = self.slot_sample[s], None
            self.pool.move(d, s)
            run.admitted_at[d] = run.admitted_at.pop(s)

    def _apply_stop_strings(self, stop_check, run: _Run) -> None:
        """Cut each live sequence at its first stop string. One that reached eos (or its last
        token) since the last check is checked once more, on its text before the eos (a stop string
        before the eos still cuts)."""
        slots = [(s, i) for s, i in enumerate(self.slot_sample)
                 if i is not None and i not in run.stopped_at and i not in run.settled]
        if not slots:
            return
        at = torch.tensor([s for s, _ in slots], device=self.device)
        done = self.state.done[at].tolist()
        produced = self.state.step[at].clamp(max=run.max_new_tokens).tolist()
        rows = self.state.out_tokens[at].tolist()
        eos = set(self.state.eos.tolist())
        newly = []
        for (s, i), is_done, length, row in zip(slots, done, produced, rows):
            row = row[:length]
            if is_done:
                run.settled.add(i)
                row = row[:next((j for j, token in enumerate(row) if token in eos), len(row))]
            cut = stop_check(i, row)
            if cut is not None:
                run.stopped_at[i] = cut
                if not is_done:
                    newly.append(s)
        if newly:
            self.state.done[torch.tensor(newly, device=self.device)] = True

    def _collect(self, run: _Run, eos_ids, ignore_eos, timings) -> Generation:
        eos = set() if ignore_eos else set(eos_ids)
        out = Generation([], [], [], timings)
        for i, (row, logprobs) in enumerate(zip(run.tokens, run.logprobs)):
            cut = next((j + 1 for j, t in enumerate(row) if t in eos), None)
            if i in run.stopped_at and (cut is None or run.stopped_at[i] < cut):
                cut = run.stopped_at[i]
            stopped = cut is not None
            cut = cut or run.caps[i]
            out.tokens.append(row[:cut])
            out.logprobs.append(logprobs[:cut])
            out.stopped.append(stopped)
        return out

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
