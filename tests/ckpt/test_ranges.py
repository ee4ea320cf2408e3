"""The sharded layout's ranges without a process group: files written as N ranks would (torch.chunk
rows, empty last ranks), read back as M ranks, including overlaps that cut saved ranges."""

import pytest
import torch

from rlscale.ckpt import ranges
from rlscale.ckpt.engine import FileSpec, RankEngine
from rlscale.ckpt.reader import read_pieces

TENSORS = {"w": torch.arange(7 * 5, dtype=torch.float32).reshape(7, 5), "short": torch.arange(3, dtype=torch.int64),
           "step": torch.tensor(4.0)}


def _save(directory, world: int, block_bytes: int) -> dict:
    """Each rank's rows (torch.chunk, as FSDP2) in its own file; the 0-d tensor whole, by rank 0."""
    found = []
    for rank in range(world):
        held, rows = {}, {}
        for name, tensor in TENSORS.items():
            if tensor.dim() == 0:
                if rank == 0:
                    held[name], rows[name] = tensor, (0, ())
                continue
            chunks = torch.chunk(tensor, world)
            if rank < len(chunks) and chunks[rank].shape[0]:
                held[name] = chunks[rank].clone()
                rows[name] = (sum(c.shape[0] for c in chunks[:rank]), tuple(tensor.shape))
        spec = FileSpec(f"policy/shard-r{rank:03d}-000.safetensors", held, rows=rows)
        engine = RankEngine(writers=1, budget_bytes=1 << 20, pinned=False)
        old = ranges.BLOCK_BYTES
        ranges.BLOCK_BYTES = block_bytes
        try:
            engine.snapshot(directory, [spec])
            found += engine.finish()["ranges"]
        finally:
            ranges.BLOCK_BYTES = old
            engine.close()
    return ranges.table(found)


@pytest.mark.parametrize("saved, loaded, block_bytes, verify", [
    (4, 2, 1 << 20, False), (2, 4, 1 << 20, False), (4, 3, 1 << 20, True), (3, 4, 10, True), (3, 4, 40, True), (4, 1, 10, True)])
def test_any_rank_count_reads_back_exactly_its_rows(tmp_path, saved, loaded, block_bytes, verify):
    table = _save(tmp_path, saved, block_bytes)
    assert table["step"]["ranges"][0]["rows"] == [0, 1]
    total = sum(r["length"] for e in table.values() for r in e["ranges"])
    assert total == sum(t.numel() * t.element_size() for t in TENSORS.values())
    for rank in range(loaded):
        pieces, expected = [], {}
        for name, tensor in TENSORS.items():
            if tensor.dim() == 0:
                part, start = tensor, 0
            else:
                chunks = torch.chunk(tensor, loaded)
                part = chunks[rank] if rank < len(chunks) else tensor[:0]
                start = sum(c.shape[0] for c in chunks[:rank])
            dest = torch.full_like(part, -1)
            pieces += ranges.plan_reads(table[name], tmp_path, start, start + ranges.rows_of(tuple(part.shape)),
                                        dest, verify)
            expected[name] = (part, dest)
        got = read_pieces(pieces, readers=2)
        for name, (part, dest) in expected.items():
            assert torch.equal(part, dest), (name, rank)
        if not verify:  # exactly its rows, nothing more
            assert got == sum(p.numel() * p.element_size() for p, _ in expected.values())


def test_a_gap_or_an_overlap_in_the_rows_is_refused():
    def entry(rows):
        return {"name": "w", "dtype": "F32", "shape": [4], "file": "f", "offset": 0, "length": 4 * (rows[1] - rows[0]),
                "rows": rows, "checksum": "x"}

    assert ranges.table([entry([2, 4]), entry([0, 2])])["w"]["ranges"][0]["rows"] == [0, 2]
    with pytest.raises(ValueError, match="by no rank"):
        ranges.table([entry([0, 1]), entry([2, 4])])
    with pytest.raises(ValueError, match="twice"):
        ranges.table([entry([0, 3]), entry([2, 4])])
    with pytest.raises(ValueError, match="by no rank"):
        ranges.table([entry([0, 3])])
