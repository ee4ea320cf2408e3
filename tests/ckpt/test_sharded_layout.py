"""The sharded layout (rlscale/ckpt/ranges.py) with real gloo ranks on CPU and real fsynced files.

One module fixture runs the scenario, each test asserts one promise of it:
  4 FSDP2 ranks train a step and save step_1: nothing gathered, each rank writes ~1/4
  the same 4 processes load step_1 into fresh workers (4 -> 4)
  2 ranks load step_1 (4 -> 2, checksums verified) and save step_2 in one-row ranges
  4 ranks, already trained elsewhere, load step_2 (2 -> 4, checksums verified, in place)
  one plain worker loads step_1 (4 -> 1) and saves step_3 in today's layout (a HF dir)
Ranks report what they saw (bytes read, gathers called, mismatches) as JSON under out/.

Below it, test_faults.py's kill -9 suite on this layout: two forked FSDP2 ranks save steps 1..4
(keep_top_k=2, async or not) and one of them is SIGKILLed at a seeded passage of each fault point
(RLSCALE_FAULT_SEED, as there); two fresh ranks then load the newest intact step and save the next.
"""

import faulthandler
import hashlib
import json
import multiprocessing
import os
import random
import signal
import threading
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from rlscale.ckpt import Checkpointer, layout, ranges
from rlscale.ckpt import faults as fault_points
from rlscale.ckpt.checkpointer import wait_for_writers
from rlscale.ckpt.faults import ENV
from rlscale.ckpt.tools import export_policy, loadable_policy_dir
from rlscale.config import CheckpointingConfig
from rlscale.errors import UserError
from rlscale.workers.group import LocalWorkerGroup
from rlscale.workers.state_io import CheckpointableWorker, model_tensors, optimizer_flat
from tests.ckpt.conftest import DEVICE, train_steps
from tests.ckpt.test_faults import PHASES, SAVES, SEED, _record, read_log
from tests.ckpt.test_fsdp import DistGroup, whole_state

pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="the sharded ranks run on CPU with gloo")

VERIFY = CheckpointingConfig(writers_per_rank=2, keep_top_k=None, verify_checksums=True)
NO_VERIFY = CheckpointingConfig(writers_per_rank=2, keep_top_k=None, verify_checksums=False)


class Worker(CheckpointableWorker):
    """The tiny model with AdamW; FSDP2-sharded (every layer, then the root) when `shard`."""

    def __init__(self, model_dir: str, rank: int, world_size: int, settings, shard: bool):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.rank, self.world_size, self.device, self.ckpt_settings = rank, world_size, torch.device("cpu"), settings
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir)
        if shard:
            from torch.distributed.fsdp import fully_shard

            for layer in self.model.model.layers:
                fully_shard(layer)
            fully_shard(self.model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=2e-4)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0)


class ReadCounter:
    """Bytes read by os.preadv (what the ranged reader reads with), counted while inside."""

    def __enter__(self):
        self.bytes, self._real = 0, os.preadv

        def counting(fd, buffers, offset, *args):
            got = self._real(fd, buffers, offset, *args)
            self.bytes += got
            return got

        os.preadv = counting
        return self

    def __exit__(self, *exc):
        os.preadv = self._real


class GatherWatch:
    """Records every call that gathers a DTensor or a tensor over ranks while inside: the DTensor
    entry points and the collectives beneath them (functional and c10d). The test harness's own
    all_gather_object (DistGroup: the controller's view of every rank's results) is not one."""

    def __enter__(self):
        from torch.distributed import _functional_collectives as funcol
        from torch.distributed import distributed_c10d as c10d
        from torch.distributed.tensor import DTensor

        self.calls, self._undo = [], []
        functional = [(funcol, name) for name in dir(funcol)
                      if name.startswith(("all_gather", "broadcast", "all_to_all")) and callable(getattr(funcol, name))]
        for owner, name in [(DTensor, "full_tensor"), (DTensor, "redistribute"), *functional,
                            (c10d, "all_gather_into_tensor"), (c10d, "_all_gather_base"),
                            (dist, "all_gather_into_tensor"), (c10d, "broadcast"), (c10d, "scatter"),
                            (c10d, "all_to_all_single")]:
            real = getattr(owner, name)
            self._undo.append((owner, name, real))
            setattr(owner, name, self._recording(name, real))
        return self

    def _recording(self, name, real):
        def call(*args, **kwargs):
            self.calls.append(name)
            return real(*args, **kwargs)
        return call

    def __exit__(self, *exc):
        for owner, name, real in reversed(self._undo):
            setattr(owner, name, real)


def _save(ckpt: Checkpointer, group: DistGroup, root: str, step: int) -> None:
    """A save by every rank: rank 0 runs the controller's side (snapshot, commit thread), the
    others mirror its calls, poll for poll (as test_fsdp.py does)."""
    if dist.get_rank() == 0:
        ckpt.save(step, group, {"step": step}, {})
        ckpt.wait()
    else:
        tmp = str(Path(root) / layout.tmp_dir_name(step))
        group.run_all("checkpoint_snapshot", [(tmp,)] * group.world_size)
        wait_for_writers(group)
    dist.barrier()


def _mismatches(worker, expected: dict[str, torch.Tensor]) -> list[str]:
    """Names whose whole tensor differs from `expected` (collective: every rank calls it)."""
    state = whole_state(worker)
    return sorted(set(state) ^ set(expected)) + [n for n in state if n in expected and not torch.equal(state[n], expected[n])]


def _load(worker, root: str, step: int) -> dict:
    group = DistGroup(worker)
    ckpt = Checkpointer(Path(root), worker.ckpt_settings, "{}\n", "test")
    torch.manual_seed(1000 + dist.get_rank()), random.seed(1000 + dist.get_rank())  # the load must restore them
    with ReadCounter() as counter:
        trainer_state = ckpt.load(Path(root) / f"step_{step}", group)
    return {"bytes_read": counter.bytes, "trainer_state": trainer_state,
            "rng": torch.get_rng_state().tolist(), "py_rng": list(random.getstate()[1]),
            "meta": optimizer_flat(worker.model, worker.optimizer, worker.scheduler)[1]}


def _report(out: str, phase: str, data: dict) -> None:
    Path(out, f"{phase}-rank{dist.get_rank()}.json").write_text(json.dumps(data))


def _ranks(rank: int, world: int, rdzv: str, phase: str, model_dir: str, root: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=world)
    try:
        if phase == "save4":
            worker = Worker(model_dir, rank, world, VERIFY, shard=True)
            train_steps(worker, steps=1, seed=7)
            saved = whole_state(worker)  # gathered here, before the save, for the comparisons
            if rank == 0:
                save_file(saved, f"{out}/saved.safetensors")
            rng = {"rng": torch.get_rng_state().tolist(), "py_rng": list(random.getstate()[1]),
                   "meta": optimizer_flat(worker.model, worker.optimizer, worker.scheduler)[1]}
            with GatherWatch() as watch:
                _save(Checkpointer(Path(root), VERIFY, "{}\n", "test"), DistGroup(worker), root, 1)
            with GatherWatch() as probe:  # the watch does see a gather (what the old save ran)
                whole_state(worker)
            _report(out, "save4", {"gathers": watch.calls, "probe": probe.calls, **rng})
            fresh = Worker(model_dir, rank, world, VERIFY, shard=True)  # 4 -> 4
            loaded = _load(fresh, root, 1)
            _report(out, "load4to4", {**loaded, "mismatches": _mismatches(fresh, saved)})
        elif phase == "load4to2":
            worker = Worker(model_dir, rank, world, VERIFY, shard=True)
            loaded = _load(worker, root, 1)
            _report(out, "load4to2", {**loaded, "mismatches": _mismatches(worker, load_file(f"{out}/saved.safetensors"))})
            ranges.BLOCK_BYTES = 1  # one range per row: the 4-rank load of step_2 verifies exactly its rows
            with GatherWatch() as watch:
                _save(Checkpointer(Path(root), VERIFY, "{}\n", "test"), DistGroup(worker), root, 2)
            _report(out, "save2", {"gathers": watch.calls})
        elif phase == "load2to4":
            worker = Worker(model_dir, rank, world, VERIFY, shard=True)
            train_steps(worker, steps=1, seed=99)  # the optimizer has state: the load reads into it
            loaded = _load(worker, root, 2)
            _report(out, "load2to4", {**loaded, "mismatches": _mismatches(worker, load_file(f"{out}/saved.safetensors"))})
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawn(phase: str, world: int, model_dir, root: Path, out: Path) -> None:
    mp.spawn(_ranks, args=(world, str(out / f"rdzv-{phase}"), phase, str(model_dir), str(root), str(out)), nprocs=world)


def _reports(out: Path, phase: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob(f"{phase}-rank*.json"))]


@pytest.fixture(scope="module")
def scenario(tiny_model_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("sharded")
    root, out = base / "ckpt", base / "out"
    root.mkdir(), out.mkdir()
    _spawn("save4", 4, tiny_model_dir, root, out)
    _spawn("load4to2", 2, tiny_model_dir, root, out)
    _spawn("load2to4", 4, tiny_model_dir, root, out)
    return {"root": root, "out": out, "model_dir": tiny_model_dir, "saved": load_file(out / "saved.safetensors")}


def _plain_group(model_dir, settings) -> LocalWorkerGroup:
    return LocalWorkerGroup(lambda rank, size: Worker(str(model_dir), rank, size, settings, shard=False), 1)


def _tensor_bytes(manifest: dict) -> int:
    return sum(r["length"] for entry in manifest["tensors"].values() for r in entry["ranges"])


def _written_by_rank(manifest: dict, world: int) -> list[int]:
    return [sum(size for rel, size in manifest["files"].items()
                if rel.startswith((f"policy/shard-r{rank:03d}-", f"optim/shard-r{rank:03d}-"))) for rank in range(world)]


def test_a_four_rank_save_gathers_nothing_and_each_rank_writes_a_quarter(scenario):
    manifest = layout.read_manifest(scenario["root"] / "step_1")
    assert manifest["format"] == 3 and manifest["world_size"] == 4
    for report in _reports(scenario["out"], "save4") + _reports(scenario["out"], "save2"):
        assert report["gathers"] == []
    assert all({"full_tensor", "all_gather_single"} <= set(r["probe"]) for r in _reports(scenario["out"], "save4"))
    # every tensor is saved once: the ranges hold exactly the state's bytes, each row by one rank
    saved = scenario["saved"]
    assert set(manifest["tensors"]) == set(saved)
    assert _tensor_bytes(manifest) == sum(t.numel() * t.element_size() for t in saved.values())
    written = _written_by_rank(manifest, 4)
    total = sum(written)
    assert total == sum(size for rel, size in manifest["files"].items() if "/shard-r" in rel)
    for rank_bytes in written:
        assert abs(rank_bytes - total / 4) <= 0.1 * total / 4, written
    assert not (scenario["root"] / "step_1" / "policy" / "model.safetensors.index.json").exists()
    from rlscale.ckpt.tools import list_steps

    assert {row["step"]: row["layout"] for row in list_steps(scenario["root"])}[1] == "sharded"
    assert layout.verify_step_dir(scenario["root"] / "step_1", checksums=True).ok


def test_two_ranks_write_half_each_in_one_row_ranges(scenario):
    manifest = layout.read_manifest(scenario["root"] / "step_2")
    assert manifest["world_size"] == 2
    embed = manifest["tensors"]["model.embed_tokens.weight"]
    assert all(r["rows"][1] - r["rows"][0] == 1 for r in embed["ranges"]) and len(embed["ranges"]) == embed["shape"][0]
    written = _written_by_rank(manifest, 2)
    for rank_bytes in written:
        assert abs(rank_bytes - sum(written) / 2) <= 0.1 * sum(written) / 2, written


@pytest.mark.parametrize("phase, saved_world, world", [("load4to4", 4, 4), ("load4to2", 4, 2), ("load2to4", 2, 4)])
def test_ranked_loads_are_bit_equal_and_each_rank_reads_its_share(scenario, phase, saved_world, world):
    step = 1 if saved_world == 4 else 2
    total = _tensor_bytes(layout.read_manifest(scenario["root"] / f"step_{step}"))
    save_reports = _reports(scenario["out"], "save4")
    reports = _reports(scenario["out"], phase)
    assert len(reports) == world
    for rank, report in enumerate(reports):
        assert report["mismatches"] == [], (rank, report["mismatches"][:5])
        assert report["trainer_state"] == {"step": step}
        assert report["meta"] == save_reports[0]["meta"]  # param groups and scheduler
        assert abs(report["bytes_read"] - total / world) <= 0.1 * total / world, (rank, report["bytes_read"], total)
        if rank < saved_world and step == 1:  # the RNG of the rank that saved it
            assert report["rng"] == save_reports[rank]["rng"] and report["py_rng"] == save_reports[rank]["py_rng"]


def test_one_plain_worker_loads_a_sharded_step_reading_it_once(scenario):
    group = _plain_group(scenario["model_dir"], NO_VERIFY)
    ckpt = Checkpointer(scenario["root"], NO_VERIFY, "{}\n", "test")
    torch.manual_seed(5)
    with ReadCounter() as counter:
        ckpt.load(scenario["root"] / "step_1", group)
    assert counter.bytes == _tensor_bytes(layout.read_manifest(scenario["root"] / "step_1"))
    worker = group.workers[0]
    state = whole_state(worker)
    assert state.keys() == scenario["saved"].keys()
    for name, tensor in scenario["saved"].items():
        assert torch.equal(state[name], tensor), name
    assert torch.get_rng_state().tolist() == _reports(scenario["out"], "save4")[0]["rng"]


def test_export_of_a_sharded_step_equals_the_export_of_the_same_state_saved_unsharded(scenario, tmp_path):
    from transformers import AutoModelForCausalLM

    root = scenario["root"]
    group = _plain_group(scenario["model_dir"], NO_VERIFY)
    ckpt = Checkpointer(root, NO_VERIFY, "{}\n", "test")
    ckpt.load(root / "step_1", group)
    ckpt.save(3, group, {"step": 3}, {})  # one worker, unsharded: today's layout
    ckpt.wait()
    assert "tensors" not in layout.read_manifest(root / "step_3")

    sharded_out, plain_out = export_policy(root / "step_1", tmp_path / "a"), export_policy(root / "step_3", tmp_path / "b")
    # what `rlscale eval --checkpoint` loads: policy/ itself when whole, an export when sharded
    assert loadable_policy_dir(root / "step_3", tmp_path / "c") == root / "step_3" / "policy"
    assert not (tmp_path / "c").exists()
    assert load_file(loadable_policy_dir(root / "step_1", tmp_path / "d") / "model.safetensors").keys() == \
        load_file(sharded_out / "model.safetensors").keys()
    a, b = load_file(sharded_out / "model.safetensors"), _hf_weights(plain_out)
    assert a.keys() == b.keys() and a
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    ids = torch.tensor([[5, 9, 12, 40, 7, 3]])
    models = [AutoModelForCausalLM.from_pretrained(path).eval() for path in (sharded_out, plain_out)]
    with torch.no_grad():
        logits = [model(input_ids=ids).logits for model in models]
    assert torch.equal(logits[0], logits[1])
    # and step_3's policy/ is itself the Hugging Face dir a one-worker run keeps writing
    direct = AutoModelForCausalLM.from_pretrained(root / "step_3" / "policy")
    assert all(torch.equal(t, scenario["saved"][n]) for n, t in direct.state_dict().items() if n in scenario["saved"])

    again = _plain_group(scenario["model_dir"], NO_VERIFY)  # today's layout still loads
    ckpt.load(root / "step_3", again)
    state = whole_state(again.workers[0])
    assert all(torch.equal(state[n], t) for n, t in scenario["saved"].items())


def _hf_weights(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(load_file(path))
    return out


def test_a_damaged_range_is_caught_by_the_rank_that_reads_it(scenario, tmp_path):
    import shutil

    step = tmp_path / "ckpt" / "step_1"
    shutil.copytree(scenario["root"] / "step_1", step)
    entry = layout.read_manifest(step)["tensors"]["model.layers.1.mlp.up_proj.weight"]
    victim = entry["ranges"][-1]
    with open(step / victim["file"], "r+b") as handle:  # flip one byte inside that range
        handle.seek(victim["offset"] + 3)
        byte = handle.read(1)
        handle.seek(victim["offset"] + 3)
        handle.write(bytes([byte[0] ^ 0xFF]))
    ckpt = Checkpointer(step.parent, VERIFY, "{}\n", "test")
    with pytest.raises(UserError, match="checksum"):
        ckpt.load(step, _plain_group(scenario["model_dir"], VERIFY))
    with pytest.raises(UserError, match="damaged"):
        export_policy(step, tmp_path / "export")


# ------------------------------------------------ the kill -9 suite (test_faults.py) on the sharded layout
#
# Each case forks two FSDP2 ranks that train and save steps 1..SAVES (keep_top_k=2, async or not):
# rank 0 is the controller as well (snapshot, the commit thread, retention), rank 1 mirrors its
# calls. RLSCALE_FAULT, set in one rank alone, SIGKILLs it at a seeded passage of a fault point:
# the controller's points kill rank 0; persist.after_file either rank, whose writer threads persist
# its own rows. Each rank logs (fsynced) the state it saves at each step, rank 0 the commits it
# saw and the whole state (gathered) to safetensors. Then: every step_N left verifies, the newest
# intact one is the newest step whose commit began its rename before the kill (so at least every
# commit seen), prepare() leaves no debris, two fresh sharded ranks load it bit for bit (weights,
# moments, optimizer meta, each rank's RNG) and the run goes on: the next save commits.

SHARDED_FILES_PER_SAVE = (11, 6)  # the files each rank's writers write in one save (tiny model, two
# ranks, writers_per_rank=2): rank 0 its 2 weight and 2 moment shards, optim/meta.json, policy/'s
# config.json, generation_config.json, tokenizer.json, tokenizer_config.json and its 2 rng/ files;
# rank 1 its 4 shards and 2 rng/ files (counted against a real run below)
SHARDED_PASSES = {  # fault point -> its passages on (rank 0, rank 1) in a run of SAVES saves
    **{point: (passes, 0) for point, passes in PHASES.items()},  # the controller runs on rank 0
    "persist.after_file": tuple(SAVES * files for files in SHARDED_FILES_PER_SAVE),
}
KILL_WORLD = len(SHARDED_FILES_PER_SAVE)
NEVER = 10**9  # an nth passage no run reaches: RLSCALE_FAULT then only counts


def sharded_kill_cases(seed: int) -> list[tuple[str, int, int, bool]]:
    """(point, rank killed, nth passage in that rank, async_save): every point once, at a seeded
    random passage of the rank that passes it (persist.after_file: a seeded rank)."""
    rng = random.Random(seed)
    cases = []
    for point, passes in SHARDED_PASSES.items():
        rank = rng.randrange(KILL_WORLD) if point == "persist.after_file" else 0
        cases.append((point, rank, rng.randint(1, passes[rank]), rng.random() < 0.75))
    return cases


def _newest_after_kill(point: str, rank: int, nth: int) -> int | None:
    """The newest step that must be committed after the kill, async or not: a save waits for the
    previous commit before its snapshot, and a step is committed once its rename is done."""
    if point == "persist.after_file":
        done = (nth - 1) // SHARDED_FILES_PER_SAVE[rank]  # the nth passage is in save done + 1
    elif point in ("commit.after_rename", "commit.after_fsync"):
        done = nth
    elif point == "retention.renamed_aside":  # step nth is dropped as step nth + 2 commits
        done = nth + 2
    else:  # snapshot.*, commit.before_manifest, commit.after_manifest: save nth is not committed
        done = nth - 1
    return done or None


def _kill_settings(async_save: bool) -> CheckpointingConfig:
    return CheckpointingConfig(writers_per_rank=2, keep_top_k=2, verify_checksums=True, async_save=async_save)


def _rank_state(worker) -> dict:
    """What this rank saves, as comparable values: its rows of every weight and moment (a digest),
    its RNG states (digests) and the optimizer's param groups and scheduler."""
    moments, meta = optimizer_flat(worker.model, worker.optimizer, worker.scheduler)
    rows = hashlib.sha256()
    for name, tensor in [*sorted(model_tensors(worker.model).items()), *sorted(moments.items())]:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        rows.update(name.encode() + local.detach().contiguous().numpy().tobytes())
    return {"rows": rows.hexdigest(), "rng": hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest(),
            "py_rng": hashlib.sha256(repr(random.getstate()).encode()).hexdigest(), "meta": meta}


def _saving_rank(rank: int, rdzv: str, fault: str | None, model_dir: str, root: str, out: str,
                 async_save: bool) -> None:
    """One rank of a run that trains and saves steps 1..SAVES; SIGKILLed by `fault` (or not)."""
    log, code = Path(out, f"rank{rank}.jsonl"), 1
    try:
        faulthandler.enable(open(Path(out, f"rank{rank}.crash"), "w"), all_threads=True)  # a crash's stacks
        torch.set_num_threads(1)
        if fault:
            os.environ[ENV] = fault
        dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=KILL_WORLD,
                                timeout=timedelta(seconds=60))
        settings = _kill_settings(async_save)
        worker = Worker(model_dir, rank, KILL_WORLD, settings, shard=True)
        # the controller's calls (rank 0's commit thread polling every rank's writers) on a group
        # of their own, beside the next step's FSDP collectives, as an async save's persist
        # overlaps the training loop
        group = DistGroup(worker, dist.new_group(backend="gloo"))
        ckpt = Checkpointer(Path(root), settings, "{}\n", "test")
        if rank == 0:
            ckpt.prepare()  # as the controller does: claimed, debris removed
        mirror = None  # rank 1: polls the writers as rank 0's commit thread does, poll for poll
        for step in range(1, SAVES + 1):
            train_steps(worker, steps=1, seed=step)
            state = whole_state(worker)  # collective: gathered by every rank, kept by rank 0
            if rank == 0:
                save_file(state, f"{out}/state_{step}.safetensors")
            _record(log, saved=step, **_rank_state(worker))
            if rank == 0:
                report = ckpt.save(step, group, {"step": step}, {})  # committed already when not async
                for done in ([report] if report.committed else []) + ckpt.poll():
                    _record(log, committed=done.step)
            else:
                if mirror is not None:
                    mirror.join()
                tmp = str(Path(root) / layout.tmp_dir_name(step))
                group.run_all("checkpoint_snapshot", [(tmp,)] * KILL_WORLD)
                mirror = threading.Thread(target=wait_for_writers, args=(group,))
                mirror.start()
                if not async_save:
                    mirror.join()
        if rank == 0:
            for done in ckpt.close():
                _record(log, committed=done.step)
        elif mirror is not None:
            mirror.join()
        _record(log, passes=dict(fault_points._hits))  # what RLSCALE_FAULT counted (the counting test)
        dist.barrier()
        dist.destroy_process_group()
        code = 0
    except BaseException:  # a rank whose peer was killed: its collectives fail
        _record(log, error=traceback.format_exc()[-2000:])
    finally:
        os._exit(code)


def _resuming_rank(rank: int, rdzv: str, fault: str | None, model_dir: str, root: str, out: str,
                   newest: int | None) -> None:
    """One of two fresh sharded ranks: prepare (rank 0), load step `newest` (if any), train a step
    and save the next one; reports what it loaded."""
    code = 1
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=KILL_WORLD,
                                timeout=timedelta(seconds=60))
        settings = _kill_settings(async_save=False)
        worker = Worker(model_dir, rank, KILL_WORLD, settings, shard=True)
        group = DistGroup(worker)
        ckpt = Checkpointer(Path(root), settings, "{}\n", "test")
        if rank == 0:
            ckpt.prepare()
        dist.barrier()
        loaded = {}
        if newest is not None:
            torch.manual_seed(1000 + rank), random.seed(1000 + rank)  # the load must restore them
            trainer_state = ckpt.load(Path(root) / layout.step_dir_name(newest), group)
            loaded = {"trainer_state": trainer_state, **_rank_state(worker),
                      "mismatches": _mismatches(worker, load_file(f"{out}/state_{newest}.safetensors"))}
        train_steps(worker, steps=1, seed=100)
        _save(ckpt, group, root, (newest or 0) + 1)
        if rank == 0:
            ckpt.release()
        _report(out, "resumed", loaded)
        dist.barrier()
        dist.destroy_process_group()
        code = 0
    except BaseException:
        _record(Path(out, f"resumed-rank{rank}.jsonl"), error=traceback.format_exc()[-2000:])
    finally:
        os._exit(code)


def _fork_ranks(target, model_dir, root: Path, out: Path, *args, faults: dict[int, str] | None = None,
                victim: int | None = None, timeout_s: float = 120.0) -> list[int]:
    """Fork KILL_WORLD processes running target(rank, rdzv, its fault, model_dir, root, out, *args)
    and return their exit codes once all have ended. The victim (every rank, without one) gets up
    to timeout_s; then its peers get 30 s to end by themselves (their collectives fail once it is
    gone). A rank still running then is SIGKILLed and the call fails: nothing runs on in the
    directory when this returns."""
    context = multiprocessing.get_context("fork")  # no re-import of torch and transformers per rank
    rdzv = str(Path(out) / f"rdzv-{target.__name__}")
    ranks = [context.Process(target=target, args=(rank, rdzv, (faults or {}).get(rank), str(model_dir), str(root),
                                                  str(out), *args)) for rank in range(KILL_WORLD)]
    for process in ranks:
        process.start()
    order = ranks if victim is None else [ranks[victim], *(p for p in ranks if p is not ranks[victim])]
    hung = []
    for process in order:
        process.join(timeout_s if victim is None or process is order[0] else 30.0)
        if process.exitcode is None:
            hung.append(ranks.index(process))
            process.kill()
            process.join()
    assert not hung, f"ranks {hung} hung (SIGKILLed)"
    return [process.exitcode for process in ranks]


def _rank_logs(out: Path) -> list[list[dict]]:
    return [read_log(out / f"rank{rank}.jsonl") for rank in range(KILL_WORLD)]


SHARDED_CASES = sharded_kill_cases(SEED)


@pytest.mark.parametrize("point,rank,nth,async_save", SHARDED_CASES,
                         ids=[f"seed{SEED}-{i}-{p}-r{r}-{n}{'' if a else '-sync'}"
                              for i, (p, r, n, a) in enumerate(SHARDED_CASES)])
def test_a_kill_at_any_point_of_a_sharded_save_loses_no_committed_step(tiny_model_dir, tmp_path, point, rank, nth,
                                                                       async_save):
    root, out = tmp_path / "ckpt", tmp_path / "out"
    root.mkdir(), out.mkdir()
    codes = _fork_ranks(_saving_rank, tiny_model_dir, root, out, async_save,
                        faults={rank: f"{point}:{nth}"}, victim=rank)
    crashes = {p.name: p.read_text()[-3000:] for p in out.glob("rank*.crash") if p.stat().st_size}
    assert codes[rank] == -signal.SIGKILL, (codes, crashes, _rank_logs(out))  # killed where the seed said
    assert all(code != 0 for code in codes), codes  # no rank finished the run without its peer

    logs = _rank_logs(out)
    saved = [{e["saved"]: e for e in log if "saved" in e} for log in logs]
    seen_committed = [e["committed"] for e in logs[0] if "committed" in e]
    for _step, path in layout.committed_steps(root):  # a step_N is either whole or absent
        assert layout.verify_step_dir(path, checksums=True).ok, path
    newest = layout.latest_intact(root)
    step = int(newest.name.split("_")[1]) if newest is not None else None
    assert step == _newest_after_kill(point, rank, nth), (step, sorted(p.name for p in root.iterdir()))
    if seen_committed:
        assert step is not None and step >= max(seen_committed)
    assert {s for s, _ in layout.committed_steps(root)} <= set(saved[0])  # no step that was not saved

    ckpt = Checkpointer(root, _kill_settings(async_save), "{}\n", "test")
    ckpt.prepare()  # removes what the kill left half-written
    assert not layout.stale_tmp_dirs(root)
    ckpt.release()

    codes = _fork_ranks(_resuming_rank, tiny_model_dir, root, out, step)
    assert codes == [0] * KILL_WORLD, (codes, [read_log(out / f"resumed-rank{r}.jsonl") for r in range(KILL_WORLD)])
    if step is not None:  # two fresh sharded ranks hold what the two saved at that step, bit for bit
        for r, report in enumerate(_reports(out, "resumed")):
            assert report["mismatches"] == [], (r, report["mismatches"][:5])
            assert report["trainer_state"] == {"step": step}
            logged = saved[r][step]
            assert {k: report[k] for k in ("rows", "rng", "py_rng", "meta")} == \
                {k: logged[k] for k in ("rows", "rng", "py_rng", "meta")}, r
    # and the run goes on: the next save commits
    assert layout.latest_intact(root) == root / layout.step_dir_name((step or 0) + 1)
    assert layout.verify_step_dir(root / layout.step_dir_name((step or 0) + 1), checksums=True).ok
    assert not layout.stale_tmp_dirs(root)


def test_the_sharded_cases_cover_every_fault_point_once_both_ranks_writers_and_reproduce():
    assert set(SHARDED_PASSES) == set(PHASES)  # test_faults.py's points, no fewer
    cases = sharded_kill_cases(SEED)
    assert [point for point, *_ in cases] == list(SHARDED_PASSES)
    for point, rank, nth, _async in cases:
        assert 1 <= nth <= SHARDED_PASSES[point][rank], (point, rank, nth)
        assert rank == 0 or point == "persist.after_file"
    assert sharded_kill_cases(SEED) == cases  # the seed reproduces them
    # over seeds, the writers of both ranks and both modes are drawn
    drawn = [case for seed in range(20) for case in sharded_kill_cases(seed)]
    assert {r for p, r, _, _ in drawn if p == "persist.after_file"} == set(range(KILL_WORLD))
    assert {a for *_, a in drawn} == {True, False}


@pytest.mark.parametrize("async_save", [True, False], ids=["persist-async", "retention-sync"])
def test_the_passages_the_cases_draw_from_are_those_of_a_real_sharded_run(tiny_model_dir, tmp_path, async_save):
    """Two ranks save steps 1..SAVES unharmed, RLSCALE_FAULT counting persist.after_file (async) or
    retention.renamed_aside (sync) in each: SHARDED_PASSES cannot drift from what a save does."""
    root, out = tmp_path / "ckpt", tmp_path / "out"
    root.mkdir(), out.mkdir()
    point = "persist.after_file" if async_save else "retention.renamed_aside"
    faults = {rank: f"{point}:{NEVER}" for rank in range(KILL_WORLD)}
    codes = _fork_ranks(_saving_rank, tiny_model_dir, root, out, async_save, faults=faults)
    logs = _rank_logs(out)
    assert codes == [0] * KILL_WORLD, (codes, logs)
    passes = [next(e["passes"] for e in log if "passes" in e).get(point, 0) for log in logs]
    assert tuple(passes) == SHARDED_PASSES[point]
    assert [e["committed"] for e in logs[0] if "committed" in e] == list(range(1, SAVES + 1))
    assert [s for s, _ in layout.committed_steps(root)] == [SAVES - 1, SAVES]  # keep_top_k=2
    last = root / layout.step_dir_name(SAVES)
    assert layout.verify_step_dir(last, checksums=True).ok
    # the manifest agrees: every rank's files and the controller's two (trainer state, config)
    manifest = layout.read_manifest(last)
    assert manifest["format"] == 3 and manifest["world_size"] == KILL_WORLD
    assert len(manifest["files"]) == sum(SHARDED_FILES_PER_SAVE) + 2
    assert sum(rel.startswith(("policy/shard-r001-", "optim/shard-r001-", "rng/rank1."))
               for rel in manifest["files"]) == SHARDED_FILES_PER_SAVE[1]
