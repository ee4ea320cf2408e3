"""The sharded layout (rlscale/ckpt/ranges.py) with real gloo ranks on CPU and real fsynced files.

One module fixture runs the scenario, each test asserts one promise of it:
  4 FSDP2 ranks train a step and save step_1: nothing gathered, each rank writes ~1/4
  the same 4 processes load step_1 into fresh workers (4 -> 4)
  2 ranks load step_1 (4 -> 2, checksums verified) and save step_2 in one-row ranges
  4 ranks, already trained elsewhere, load step_2 (2 -> 4, checksums verified, in place)
  one plain worker loads step_1 (4 -> 1) and saves step_3 in today's layout (a HF dir)
Ranks report what they saw (bytes read, gathers called, mismatches) as JSON under out/.
"""

import json
import os
import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from rlscale.ckpt import Checkpointer, layout, ranges
from rlscale.ckpt.checkpointer import wait_for_writers
from rlscale.ckpt.tools import export_policy, loadable_policy_dir
from rlscale.config import CheckpointingConfig
from rlscale.errors import UserError
from rlscale.workers.group import LocalWorkerGroup
from rlscale.workers.state_io import CheckpointableWorker, optimizer_flat
from tests.ckpt.conftest import DEVICE, train_steps
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
        elif phase.startswith("kill:"):  # step_1 commits, then rank 0 is SIGKILLed in step_2's save
            worker = Worker(model_dir, rank, world, VERIFY, shard=True)
            ckpt, group = Checkpointer(Path(root), VERIFY, "{}\n", "test"), DistGroup(worker)
            for step in (1, 2):
                train_steps(worker, steps=1, seed=step)
                state = whole_state(worker)
                if rank == 0:
                    save_file(state, f"{out}/state_{step}.safetensors")
                    if step == 2:
                        os.environ["RLSCALE_FAULT"] = phase[len("kill:"):]
                _save(ckpt, group, root, step)
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


@pytest.mark.parametrize("point", ["persist.after_file:2", "commit.before_manifest:1", "commit.after_rename:1"])
def test_a_kill_during_a_sharded_save_keeps_the_newest_intact_step_loadable(tiny_model_dir, tmp_path, point):
    root, out = tmp_path / "ckpt", tmp_path / "out"
    root.mkdir(), out.mkdir()
    with pytest.raises(mp.ProcessExitedException):  # rank 0 killed; spawn ends the other rank too
        _spawn(f"kill:{point}", 2, tiny_model_dir, root, out)
    ckpt = Checkpointer(root, VERIFY, "{}\n", "test")
    ckpt.prepare()  # removes what the kill left half-written
    latest = ckpt.latest()
    assert latest is not None and not layout.stale_tmp_dirs(root)
    assert latest.name == ("step_2" if point.startswith("commit.after_rename") else "step_1")
    assert layout.verify_step_dir(latest, checksums=True).ok
    group = _plain_group(tiny_model_dir, VERIFY)
    ckpt.load(latest, group)
    ckpt.release()
    expected = load_file(out / f"state_{latest.name.split('_')[1]}.safetensors")
    state = whole_state(group.workers[0])
    assert state.keys() == expected.keys() and all(torch.equal(state[n], t) for n, t in expected.items())


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
