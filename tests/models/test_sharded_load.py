"""Start-up without whole copies (rlscale.models.sharded_load): a model built on the meta device,
FSDP2-sharded, then each rank reads from the safetensors files only the rows it keeps.

Two gloo ranks on CPU load a synthetic Qwen2 of 1.26 GB (float32, five files; vocabulary 32003
and MLP width 2047 so that dim 0 splits unevenly and rank 1's shards carry FSDP2's padding row)
and a small tied one (a single file, lm_head tied to embed_tokens). Each rank's shards, padded
storage included, equal load-then-shard bit for bit. The small model's FSDP2 logits equal the
whole model's bit for bit (the big one's forward all-gathers 1.26 GB over gloo: 25 s on 2 cores;
its padded storage, what that all-gather reads, is compared instead). The peak RSS during the load stays below the RSS before it + the rank's shard + the largest tensor + an
allowance (ALLOWANCE) for what the load allocates besides tensors (the model's Python objects,
FSDP2's state, safetensors headers).

Measured (2 CPU cores, torch 2.13, safetensors 0.8, 2026-12-02), per rank, MiB, over three runs:
    rank 0: RSS before 552-554, shard 602, largest tensor 250, peak +609..613 over before, bound +916
    rank 1: RSS before 567-569, shard 602, largest tensor 250, peak +604..614 over before, bound +916
i.e. the peak is the shard plus under 15 MiB: a tensor's slice is read straight from its file's
mapping into the shard, the mapping closed after each tensor. For comparison, from_pretrained +
shard_model in the same process afterwards peaks at +923..945 MiB (transformers maps the files
lazily, so not quite the whole 1204 MiB model at once). Rank 1 holds 18 padding rows (dim 0 of
32003 and 2047 split 16002/16001 and 1024/1023).
"""

from __future__ import annotations

import gc
import json
import re
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlscale.errors import UserError
from rlscale.models.sharded_load import load_sharded

MiB = 1 << 20
ALLOWANCE = 64 * MiB
TOKENS = torch.tensor([[3, 17, 4242, 31999, 8, 32002, 5, 12]])

BIG = dict(hidden_size=2048, intermediate_size=2047, num_hidden_layers=8, num_attention_heads=16,
           num_key_value_heads=4, vocab_size=32003, tie_word_embeddings=False, max_position_embeddings=256)
TIED = dict(hidden_size=256, intermediate_size=517, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=32003, tie_word_embeddings=True, max_position_embeddings=256)


def write_model(directory: Path, shape: dict, max_shard_size: str | None = None) -> Path:
    """A Qwen2 with random float32 weights, saved by save_pretrained (built on the meta device and
    filled with uniform noise: transformers' own init of 1.26 GB takes 9 s on one core)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**shape), dtype=torch.float32)
    model.to_empty(device="cpu")
    if shape["tie_word_embeddings"]:
        model.lm_head.weight = model.model.embed_tokens.weight
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.uniform_(-0.05, 0.05, generator=generator)
            if "norm" in name:
                param.add_(1.0)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, **kwargs)
    return directory


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded_load")
    big = write_model(root / "big", BIG, max_shard_size="300MB")
    tied = write_model(root / "tied", TIED)
    assert len(list(big.glob("*.safetensors"))) == 5 and (big / "model.safetensors.index.json").is_file()
    assert sum(f.stat().st_size for f in big.glob("*.safetensors")) > 1e9
    assert [f.name for f in tied.glob("*.safetensors")] == ["model.safetensors"]
    return big, tied


def status_bytes(key: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{key}:\s+(\d+) kB", text, re.M).group(1)) * 1024


def reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)


def local_bytes(model) -> int:
    """What this rank holds: its shards in FSDP2's padded storage, and the buffers."""
    seen, total = set(), 0
    for tensor in [*model.parameters(), *model.buffers()]:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        storage = local.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def largest_tensor_bytes(directory: Path) -> int:
    from safetensors import safe_open

    largest = 0
    for file in directory.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                piece = f.get_slice(key)
                numel = torch.Size(piece.get_shape()).numel()
                largest = max(largest, numel * torch.empty(0, dtype=_dtype(piece.get_dtype())).element_size())
    return largest


def _dtype(name: str) -> torch.dtype:
    return {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}[name]


def fsdp_params(model) -> dict[str, object]:
    """Parameter name -> its FSDPParam (which holds the padded storage the all-gather reads)."""
    from rlscale.workers.distributed import fsdp_modules

    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for module in fsdp_modules(model):
        for group in module._get_fsdp_state()._fsdp_param_groups:
            for param in group.fsdp_params:
                out[names[id(param.sharded_param)]] = param
    return out


def compare_with_load_then_shard(loaded, directory: Path, logits: bool) -> dict:
    """Bit for bit against from_pretrained + shard_model, shard by shard, FSDP2's padded storage
    (what its all-gather reads) included; with `logits`, the FSDP2 forward's logits against the
    load-then-shard model's and the unsharded whole model's. Collective (both ranks call it)."""
    from transformers import AutoModelForCausalLM

    from rlscale.workers.distributed import shard_model

    reset_peak_rss()
    before = status_bytes("VmRSS")
    whole = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    if logits:
        with torch.no_grad():
            whole_logits = whole(TOKENS).logits
    shard_model(whole)
    load_then_shard_peak = status_bytes("VmHWM") - before
    loaded_state = loaded.state_dict()
    for name, tensor in whole.state_dict().items():
        ours = loaded_state[name]
        assert type(ours) is type(tensor), name
        if hasattr(tensor, "to_local"):
            assert ours.placements == tensor.placements, name
            assert torch.equal(ours.to_local(), tensor.to_local()), name
        else:
            assert torch.equal(ours, tensor), name
    for name, buffer in whole.named_buffers():  # rotary frequencies: in no file, recomputed
        assert torch.equal(loaded.get_buffer(name), buffer), name
    padded_rows = 0
    theirs = fsdp_params(whole)
    for name, param in fsdp_params(loaded).items():
        local = param.sharded_param._local_tensor
        # the local shard is a view into the storage FSDP2 all-gathers from, padding rows after it
        assert local.untyped_storage().data_ptr() == param._sharded_param_data.untyped_storage().data_ptr(), name
        assert torch.equal(param._sharded_param_data, theirs[name]._sharded_param_data), name
        padded_rows += param.padded_sharded_param_size[0] - local.shape[0]
    if logits:
        with torch.no_grad():
            ours_logits, sharded_logits = loaded(TOKENS).logits, whole(TOKENS).logits
        assert torch.equal(ours_logits, sharded_logits)
        assert torch.equal(ours_logits, whole_logits)
    return {"padded_rows": padded_rows, "load_then_shard_peak": load_then_shard_peak}


def rank_main(rank: int, world: int, port: int, big: str, tied: str, out: str) -> None:
    from rlscale.workers.distributed import shard_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        cpu = torch.device("cpu")
        small = load_sharded(tied, torch.float32, cpu, shard_model)  # also warms up every import
        assert small.lm_head.weight is small.model.embed_tokens.weight
        tied_report = compare_with_load_then_shard(small, Path(tied), logits=True)
        del small
        gc.collect()

        reset_peak_rss()
        before = status_bytes("VmRSS")
        model = load_sharded(big, torch.float32, cpu, shard_model)
        peak = status_bytes("VmHWM")
        report = {"before": before, "peak": peak, "shard": local_bytes(model),
                  "largest": largest_tensor_bytes(Path(big)), "tied": tied_report}
        report.update(compare_with_load_then_shard(model, Path(big), logits=False))
        Path(out, f"rank{rank}.json").write_text(json.dumps(report))
        dist.barrier()  # both ranks tear down together (see tests/workers/test_distributed.py)
    finally:
        dist.destroy_process_group()


def test_two_ranks_read_only_their_shards_and_match_load_then_shard(models, tmp_path):
    big, tied = models
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(rank_main, args=(2, port, str(big), str(tied), str(tmp_path)), nprocs=2, join=True)
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    model_bytes = sum(f.stat().st_size for f in big.glob("*.safetensors"))
    for rank, r in enumerate(reports):
        bound = r["before"] + r["shard"] + r["largest"] + ALLOWANCE
        print(f"rank {rank}: before {r['before'] / MiB:.0f} MiB, shard {r['shard'] / MiB:.0f}, largest tensor "
              f"{r['largest'] / MiB:.0f}, peak {r['peak'] / MiB:.0f} (+{(r['peak'] - r['before']) / MiB:.0f}), "
              f"bound {bound / MiB:.0f}, padded rows {r['padded_rows']}; load-then-shard "
              f"+{r['load_then_shard_peak'] / MiB:.0f}")
        assert r["peak"] < bound
        assert r["shard"] + r["largest"] + ALLOWANCE < model_bytes  # the bound excludes a whole copy
        assert r["shard"] < 0.55 * model_bytes  # about half each
    assert reports[0]["padded_rows"] == 0 and reports[1]["padded_rows"] > 0  # the uneven dim 0 is on rank 1
    assert reports[1]["tied"]["padded_rows"] > 0


def test_one_process_without_sharding_and_with_a_group_of_one(models):
    """World size 1: `shard` a no-op (plain tensors, whole), and FSDP2 over a gloo group of one."""
    from transformers import AutoModelForCausalLM

    from rlscale.workers.distributed import init_process_group, shard_model

    _, tied = models
    whole = AutoModelForCausalLM.from_pretrained(str(tied), dtype=torch.float32)
    with torch.no_grad():
        expected = whole(TOKENS).logits
    plain = load_sharded(str(tied), torch.float32, torch.device("cpu"), lambda model: None)
    assert plain.lm_head.weight is plain.model.embed_tokens.weight and not plain.training
    for name, tensor in whole.state_dict().items():
        assert torch.equal(plain.state_dict()[name], tensor), name
    with torch.no_grad():
        assert torch.equal(plain(TOKENS).logits, expected)

    joined = not dist.is_initialized()  # another test of this process may have made a group of one
    if joined:
        init_process_group(0, 1, torch.device("cpu"), timeout_s=60)
    assert dist.get_world_size() == 1
    try:
        sharded = load_sharded(str(tied), torch.float32, torch.device("cpu"), shard_model)
        assert all(hasattr(p, "to_local") for p in sharded.parameters())
        for name, tensor in whole.state_dict().items():
            assert torch.equal(sharded.state_dict()[name].to_local(), tensor), name
        with torch.no_grad():
            torch.testing.assert_close(sharded(TOKENS).logits, expected, rtol=1e-6, atol=1e-6)
    finally:
        if joined:
            dist.destroy_process_group()


def test_bfloat16_matches_from_pretrained(models):
    from transformers import AutoModelForCausalLM

    _, tied = models
    whole = AutoModelForCausalLM.from_pretrained(str(tied), dtype=torch.bfloat16)
    ours = load_sharded(str(tied), torch.bfloat16, torch.device("cpu"), lambda model: None)
    for name, tensor in whole.state_dict().items():
        assert ours.state_dict()[name].dtype == tensor.dtype and torch.equal(ours.state_dict()[name], tensor), name
    for name, buffer in whole.named_buffers():
        assert ours.get_buffer(name).dtype == buffer.dtype and torch.equal(ours.get_buffer(name), buffer), name


TINY = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=97, tie_word_embeddings=False, max_position_embeddings=64)


def test_a_missing_tensor_is_named_with_its_file(tmp_path):
    from safetensors.torch import load_file, save_file

    directory = write_model(tmp_path / "m", TINY)
    weights = load_file(directory / "model.safetensors")
    del weights["model.layers.0.mlp.up_proj.weight"]
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    noop = lambda model: None  # noqa: E731
    with pytest.raises(UserError, match=r"^model weight 'model.layers.0.mlp.up_proj.weight' is missing from "
                                        r".*/m/model.safetensors$"):
        load_sharded(str(directory), torch.float32, torch.device("cpu"), noop)


def test_a_tensor_missing_from_the_file_its_index_names(tmp_path):
    directory = write_model(tmp_path / "m", TINY, max_shard_size="20KB")
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    file = index["weight_map"]["lm_head.weight"]
    index["weight_map"]["lm_head.weight"] = next(f for f in index["weight_map"].values() if f != file)
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(UserError, match=r"^model weight 'lm_head.weight' is missing from .*model-0000\d-of-0000\d"
                                        r".safetensors \(the index names that file\)$"):
        load_sharded(str(directory), torch.float32, torch.device("cpu"), lambda model: None)


def test_a_shape_that_disagrees_with_the_config_is_named_with_its_file(tmp_path):
    directory = write_model(tmp_path / "m", TINY)
    config = json.loads((directory / "config.json").read_text())
    config["intermediate_size"] = 50
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=r"^model weight 'model.layers.0.mlp.gate_proj.weight' has shape \[48, 32\] "
                                        r"in .*/m/model.safetensors, the model's config gives \[50, 32\]$"):
        load_sharded(str(directory), torch.float32, torch.device("cpu"), lambda model: None)


def test_a_directory_without_safetensors_weights(tmp_path):
    directory = write_model(tmp_path / "m", TINY)
    (directory / "model.safetensors").unlink()
    with pytest.raises(UserError, match=r"^.*/m: no safetensors weights"):
        load_sharded(str(directory), torch.float32, torch.device("cpu"), lambda model: None)
