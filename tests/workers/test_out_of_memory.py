"""Out of memory, piece by piece: the worker-side conversion into rlscale.errors.OutOfMemory (its
phase, figures, traceback), its pickling, its unwrapping from Ray's errors, the fault that injects
it and the controller's line and log. The end-to-end runs are in tests/integration/test_out_of_memory.py."""

from __future__ import annotations

import inspect
import pickle
from contextlib import contextmanager

import pytest
import torch

from rlscale.ckpt import faults
from rlscale.config_loading import load_config
from rlscale.errors import GiB, OutOfMemory, UserError, advice_for, is_out_of_memory, out_of_memory
from rlscale.workers.group import LocalWorkerGroup, call_worker, memory_guarded

CUDA_MESSAGE = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.72 GiB of "
                "which 1.06 GiB is free. Including non-PyTorch memory, this process has 138.64 GiB memory in use. "
                "Of the allocated memory 137.60 GiB is allocated by PyTorch, and 0.51 GiB is reserved by PyTorch "
                "but unallocated.")


def _oom(*_args, **_kwargs):
    raise torch.OutOfMemoryError(CUDA_MESSAGE)


@contextmanager
def gathered(model):  # named like rlscale.workers.distributed.gathered: an explicit whole-model gather
    model.unshard()
    yield


class FakeModel:
    def unshard(self):
        _oom()


class FakeWorker:
    """Method names as PolicyWorker's, failing where a real worker could run out of memory."""

    def __init__(self, rank: int = 0, world_size: int = 1):
        self.rank, self.world_size, self.device = rank, world_size, torch.device("cpu")
        self.model, self.reference = FakeModel(), object()

    def train(self, steps, fail_in: str = "update"):
        return self._train(steps, fail_in)

    def _train(self, steps, fail_in):
        if fail_in == "reference":
            return self._pack_logprobs(self.reference)
        if fail_in == "old":
            return self._pack_logprobs(self.model)
        return _oom()

    def _pack_logprobs(self, model):
        return _oom()

    def generate(self, texts, fail_in: str = "engine"):
        if fail_in == "gather":
            with gathered(self.model):
                pass
        if fail_in == "host":
            raise MemoryError()
        if fail_in == "other":
            raise RuntimeError("not a memory problem")
        return _oom()

    def checkpoint_snapshot(self, directory: str) -> dict:
        return {"directory": directory}


def _converted(method: str, *args, worker=None) -> OutOfMemory:
    with pytest.raises(OutOfMemory) as caught:
        call_worker(worker or FakeWorker(), method, *args)
    return caught.value


@pytest.mark.parametrize(("method", "args", "phase"), [
    ("train", ([1], "update"), "update"),
    ("train", ([1], "old"), "update"),  # pi_old's logprob pass belongs to the update
    ("train", ([1], "reference"), "reference logprobs"),
    ("generate", (["p"], "engine"), "generation"),
    ("generate", (["p"], "gather"), "weight sync/gather"),
])
def test_the_phase_is_the_method_refined_by_where_inside_it_the_memory_ran_out(method, args, phase):
    exc = _converted(method, *args)
    assert exc.phase == phase
    assert exc.device == "cpu" and exc.allocated > 0 and exc.total >= exc.allocated and not exc.host
    assert "torch.OutOfMemoryError: CUDA out of memory" in exc.traceback_text and "_oom" in exc.traceback_text
    assert exc.__cause__ is None and exc.__context__ is None  # the original's frames are not kept alive
    assert exc.rank is None  # one worker: no rank to name


def test_the_hosts_memory_error_is_converted_and_other_errors_pass_unchanged():
    exc = _converted("generate", ["p"], "host")
    assert exc.host and exc.device == "host" and exc.phase == "generation"
    assert "the host ran out of memory" in str(exc)
    with pytest.raises(RuntimeError, match="not a memory problem"):
        call_worker(FakeWorker(), "generate", ["p"], "other")
    assert is_out_of_memory(RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't "
                                         "allocate memory: you tried to allocate 1125899906842624 bytes"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))


def test_a_local_group_converts_and_names_the_rank_when_there_are_several():
    group = LocalWorkerGroup(lambda rank, size: FakeWorker(rank, size), 2)
    with pytest.raises(OutOfMemory) as caught:
        group.run_all("train", [([1], "update"), ([1], "update")])
    assert caught.value.rank == 0 and "on cpu, worker rank 0;" in str(caught.value)
    assert group.run_rank0("checkpoint_snapshot", "d") == {"directory": "d"}

    def fails_to_load(rank, size):
        raise torch.OutOfMemoryError(CUDA_MESSAGE)

    with pytest.raises(OutOfMemory) as caught:
        LocalWorkerGroup(fails_to_load, 1)
    assert caught.value.phase == "start-up"


def test_the_error_pickles_with_every_field_and_its_line_quotes_the_plan():
    exc = OutOfMemory("update", int(137.6 * GiB), int(138 * GiB), int(139.7 * GiB), "cuda:0 (NVIDIA H200)",
                      CUDA_MESSAGE, "Traceback ...", step=3, rank=1, planned=120 * GiB,
                      advice="set policy.activation_checkpointing=true", log_path="/runs/a/error.log")
    again = pickle.loads(pickle.dumps(exc))
    assert type(again) is OutOfMemory and again.fields() == exc.fields() and isinstance(again, UserError)
    assert str(again) == str(exc) == (
        "out of memory in update (step 3): 137.6 GiB allocated of 139.7 GiB on cuda:0 (NVIDIA H200), worker rank 1; "
        "the memory plan expected 120.0 GiB for this phase; set policy.activation_checkpointing=true; "
        "traceback in /runs/a/error.log")
    assert "\n" not in str(exc)


def test_advice_names_only_settings_the_run_has_not_made_already(tmp_path):
    plain = load_config(None, [f"logger.log_dir={tmp_path}"])
    done = load_config(None, [f"logger.log_dir={tmp_path}", "policy.activation_checkpointing=true",
                              "policy.master_weights=bf16_stochastic", "policy.shard_reference=true"])
    assert "policy.activation_checkpointing=true" in advice_for("update", plain)
    assert "policy.master_weights=bf16_stochastic" in advice_for("update", plain)
    assert advice_for("update", done) == "lower policy.train_micro_batch_tokens"
    assert "policy.shard_reference=true" in advice_for("reference logprobs", plain)
    assert "policy.shard_reference" not in advice_for("reference logprobs", done)
    generation = advice_for("generation", plain)
    assert "policy.generation.max_new_tokens" in generation and "grpo.num_prompts_per_step" in generation
    assert "grpo.max_val_samples" in advice_for("validation", plain)


def test_the_oom_fault_raises_in_the_named_call_only(monkeypatch):
    monkeypatch.setenv(faults.ENV, "worker.checkpoint_snapshot:2:OOM")
    monkeypatch.setattr(faults, "_hits", {})
    worker = FakeWorker()
    assert call_worker(worker, "checkpoint_snapshot", "a") == {"directory": "a"}
    exc = _converted("checkpoint_snapshot", "b", worker=worker)
    assert exc.phase == "checkpoint snapshot" and "injected out of memory" in exc.message
    assert call_worker(worker, "checkpoint_snapshot", "c") == {"directory": "c"}
    monkeypatch.setenv(faults.ENV, "worker.train:1:MEMORY")
    with pytest.raises(OutOfMemory) as caught:
        call_worker(worker, "train", [1])
    assert caught.value.host and caught.value.phase == "update"


def test_a_guarded_worker_class_keeps_its_name_and_signatures_and_converts_in_its_own_process():
    cls = memory_guarded(FakeWorker)
    assert cls.__name__ == "FakeWorker" and issubclass(cls, FakeWorker)  # `ray::FakeWorker` in ps
    assert inspect.signature(cls.train) == inspect.signature(FakeWorker.train)
    worker = cls(1, 2)
    with pytest.raises(OutOfMemory) as caught:
        worker.train([1], "reference")
    assert caught.value.phase == "reference logprobs" and caught.value.rank == 1
    assert worker.checkpoint_snapshot("x") == {"directory": "x"}
    cloudpickle = pytest.importorskip("ray.cloudpickle")  # what Ray ships an actor class with
    assert cloudpickle.loads(cloudpickle.dumps(cls))(0, 1).checkpoint_snapshot("y") == {"directory": "y"}


def test_a_ray_task_error_is_unwrapped_to_the_workers_error():
    pytest.importorskip("ray")
    from ray.exceptions import RayTaskError

    from rlscale.workers.ray_group import out_of_memory_cause

    ours = _converted("train", [1], "update", worker=FakeWorker(1, 2))
    wrapped = RayTaskError("PolicyWorker.train", "Traceback (remote) ...", ours)
    for error in (wrapped, wrapped.as_instanceof_cause()):  # as Ray raises it: RayTaskError(OutOfMemory)
        found = out_of_memory_cause(error.cause, rank=0)
        assert type(found) is OutOfMemory and found.fields() == ours.fields() and found.rank == 1
        assert out_of_memory_cause(error, rank=0).fields() == ours.fields()

    # an out-of-memory error that reached Ray unconverted: the figures its message gives
    raw = RayTaskError("PolicyWorker.train", "Traceback (remote) ...", torch.OutOfMemoryError(CUDA_MESSAGE))
    found = out_of_memory_cause(raw.cause, rank=3, remote_traceback=raw.traceback_str, method="train")
    assert found.phase == "update" and found.rank == 3 and found.traceback_text == "Traceback (remote) ..."
    assert str(found).startswith("out of memory in update (start-up): 137.6 GiB allocated of 139.7 GiB on cuda, "
                                 "worker rank 3; ")
    assert out_of_memory_cause(RuntimeError("other"), rank=0) is None


def test_the_controller_adds_step_plan_and_advice_and_appends_the_log(tmp_path):
    from rlscale.controller import RunPosition, _finish_out_of_memory, planned_figures

    class Plan:
        def phase_bytes(self, phase):
            return {"update": 12 * GiB, "generation": 30 * GiB}.get(phase)

    cfg = load_config(None, [f"logger.log_dir={tmp_path / 'run'}"])
    planned = planned_figures(Plan())
    assert planned == {"update": 12 * GiB, "generation": 30 * GiB}
    for _ in range(2):
        exc = _finish_out_of_memory(_converted("train", [1]), cfg, planned, RunPosition(step=7))
    line = str(exc)
    assert line.startswith("out of memory in update (step 7): ")
    assert "; the memory plan expected 12.0 GiB for this phase; set policy.activation_checkpointing=true" in line
    log = tmp_path / "run" / "error.log"
    assert line.endswith(f"; traceback in {log}")
    text = log.read_text()
    assert text.count("===== ") == 2 and text.count(f"rlscale: error: {line}") == 2  # appended
    assert "where the memory ran out:" in text and "in the controller:" in text
    other = _finish_out_of_memory(_converted("checkpoint_snapshot", "x", worker=_SnapshotOom()), cfg, planned,
                                  RunPosition(step=8))
    assert "the memory plan gave no figure" in str(other)


class _SnapshotOom(FakeWorker):
    def checkpoint_snapshot(self, directory: str) -> dict:
        return _oom()


def test_out_of_memory_from_a_message_alone_reads_its_figures():
    exc = out_of_memory(torch.OutOfMemoryError(CUDA_MESSAGE), "generate", here=False)
    assert (round(exc.allocated / GiB, 1), round(exc.total / GiB, 1)) == (137.6, 139.7)
    assert exc.device == "cuda" and exc.phase == "generation"


def test_planned_figures_from_a_plan_without_phase_bytes():
    """rlscale.memory_plan's MemoryPlan as it is: phases with names and totals."""
    from types import SimpleNamespace

    from rlscale.controller import planned_figures

    plan = SimpleNamespace(phases=[SimpleNamespace(name="weight sync", total=5.0 * GiB),
                                   SimpleNamespace(name="generation", total=9.0 * GiB),
                                   SimpleNamespace(name="update", total=20.0 * GiB),
                                   SimpleNamespace(name="optimizer step", total=22.0 * GiB)])
    assert planned_figures(plan) == {"generation": 9 * GiB, "validation": 9 * GiB, "weight sync/gather": 5 * GiB,
                                     "update": 22 * GiB}
    assert planned_figures(None) == {}


@pytest.fixture(scope="module")
def real_group():
    """A real PolicyWorker (the built-in tiny model) with a KL reference: the frames the phase is
    read from are policy.py's own."""
    from rlscale.workers.policy import PolicyWorker

    torch.set_num_threads(1)
    cfg = load_config(None, ["policy.device=cpu", "policy.cpu_threads=1", "policy.max_total_sequence_length=32",
                             "loss.reference_policy_kl_penalty=0.01", "grpo.num_prompts_per_step=4",
                             "grpo.num_generations_per_prompt=2", "policy.train_global_batch_size=4"])
    group = LocalWorkerGroup(lambda rank, size: PolicyWorker(cfg, rank, size, distributed_group=False))
    return cfg, group


@pytest.mark.parametrize(("failing", "phase"), [("reference", "reference logprobs"), ("model", "update")])
def test_a_real_workers_update_names_the_pass_that_ran_out(real_group, monkeypatch, failing, phase):
    from rlscale.controller import train_on_rollouts
    from rlscale.workers.batch import Rollouts

    cfg, group = real_group
    worker = group.workers[0]
    model = getattr(worker, failing)
    monkeypatch.setattr(model, "forward", _oom)  # the instance's forward: nn.Module.__call__ finds it
    encode = lambda text: worker.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    data = Rollouts(prompt_ids=[encode("1+2=")] * 8, response_ids=[encode("3")] * 8, texts=["3"] * 8,
                    truncated=[False] * 8)
    with pytest.raises(OutOfMemory) as caught:
        train_on_rollouts(cfg, group, data, [1.0, -1.0] * 4, 1, worker.tokenizer.pad_token_id)
    assert caught.value.phase == phase, caught.value.traceback_text
