"""The disk KV tier (workers/kv_transfer/disk_tier.py): finished requests'
blocks in files, read back instead of prefilled, also by a restarted engine;
a bad or missing file is computed instead, with the same tokens."""

from __future__ import annotations

import os
import stat

import pytest
from test_kv_host_tier import BLOCK, GREEDY, HOST_HITS, POOL_BLOCKS, SHARED, WORKLOAD, _prompt, _run, run_once

from shoal.workers import LLMEngine

FIRST, AGAIN = SHARED + _prompt(1, 20), SHARED[:40] + _prompt(3, 30)  # AGAIN: 2 of FIRST's full blocks


def _engine(model: str, path, **kw) -> LLMEngine:
    return LLMEngine(model=model, num_kv_blocks=POOL_BLOCKS, num_threads=1, kv_offload_disk_path=str(path), **kw)


def _flip(path: str, offset: int, mask: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ mask]))


def _files(root) -> list[str]:
    return [os.path.join(d, f) for d, _, names in os.walk(root) for f in names if f.endswith(".kv")]


@pytest.fixture(scope="module")
def reference(tiny_model):
    engine = LLMEngine(model=tiny_model, num_kv_blocks=POOL_BLOCKS, num_threads=1)
    try:
        return {"workload": _run(engine, WORKLOAD, GREEDY), "again": _run(engine, [AGAIN], GREEDY)}
    finally:
        engine.shutdown()


def test_blocks_from_disk_give_the_tokens_a_prefill_gives(tiny_model, reference, tmp_path):
    out, tiers = run_once(_engine(tiny_model, tmp_path), WORKLOAD)
    disk = tiers["disk"]
    assert out == reference["workload"]
    assert disk.hit_tokens == HOST_HITS and disk.loaded_blocks == HOST_HITS // BLOCK
    assert disk.saved_blocks > 0 and disk.failed_blocks == 0


def test_a_restarted_engine_finds_its_blocks_on_disk(tiny_model, reference, tmp_path):
    run_once(_engine(tiny_model, tmp_path), [FIRST])  # every write it asked for is on disk when it returns
    files = _files(tmp_path)
    assert files
    for path in files:  # the caller's alone
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    out, tiers = run_once(_engine(tiny_model, tmp_path), [AGAIN])
    assert out == reference["again"]
    assert tiers["disk"].hit_tokens == 2 * BLOCK  # the first request of the new engine, its pool empty


@pytest.mark.parametrize("damage", ["flipped byte", "missing file"])
def test_a_bad_or_missing_file_is_computed_instead(tiny_model, reference, tmp_path, damage):
    run_once(_engine(tiny_model, tmp_path), [FIRST])
    again = _engine(tiny_model, tmp_path)  # reads the headers now
    (path,) = _files(tmp_path)
    if damage == "missing file":
        os.unlink(path)
    else:
        _flip(path, os.path.getsize(path) - 100, 0xFF)  # inside the last block's data
    out, tiers = run_once(again, [AGAIN])
    disk = tiers["disk"]
    assert out == reference["again"]
    if damage == "flipped byte":
        # Only the last block's data changed, but the load reads blocks 0 and 1: they still pass.
        assert disk.failed_blocks == 0 and disk.hit_tokens == 2 * BLOCK
    else:
        assert disk.failed_blocks >= 1 and path not in _files(tmp_path)


def test_a_bad_block_is_refused_by_its_checksum(tiny_model, reference, tmp_path):
    run_once(_engine(tiny_model, tmp_path), [FIRST])
    (path,) = _files(tmp_path)
    size = os.path.getsize(path)
    num_blocks = 7  # FIRST's computed full blocks: 116 prompt + 7 output tokens
    block_bytes = 2 * 2 * BLOCK * 2 * 16 * 4
    _flip(path, size - num_blocks * block_bytes + 10, 0x01)  # one bit of block 0
    out, tiers = run_once(_engine(tiny_model, tmp_path), [AGAIN])
    assert out == reference["again"]
    assert tiers["disk"].failed_blocks == 1
    # The file with a bad block was deleted; the tokens were computed, and written again when AGAIN ended.
    assert path not in _files(tmp_path)


def test_the_tier_stays_within_its_bytes(tiny_model, reference, tmp_path):
    block_bytes = 2 * 2 * BLOCK * 2 * 16 * 4
    budget = 20 * block_bytes
    out, tiers = run_once(_engine(tiny_model, tmp_path, kv_offload_disk_bytes=budget), WORKLOAD)
    assert out == reference["workload"]
    assert tiers["disk"].evicted_blocks > 0
    assert sum(os.path.getsize(p) for p in _files(tmp_path)) <= budget


def test_engines_sharing_a_path_keep_to_their_own_slots(tiny_model, reference, tmp_path):
    """Two engines at once (a pod's workers) write apart; a restarted one takes a free slot and its blocks."""
    a, b = _engine(tiny_model, tmp_path), _engine(tiny_model, tmp_path)
    try:
        _run(a, [FIRST], GREEDY)
        _run(b, [FIRST], GREEDY)
    finally:
        a.shutdown()
        b.shutdown()  # their writes are done
    assert {os.path.basename(os.path.dirname(p)) for p in _files(tmp_path)} == {"slot0", "slot1"}
    out, tiers = run_once(_engine(tiny_model, tmp_path), [AGAIN])
    assert out == reference["again"] and tiers["disk"].hit_tokens == 2 * BLOCK


def test_an_engine_reads_the_blocks_another_slot_holds_and_leaves_its_files_alone(tiny_model, reference, tmp_path):
    """A pod's restarted workers take whichever slots come free: each reads every slot's files."""
    a = _engine(tiny_model, tmp_path)  # slot0
    try:
        _run(a, [FIRST], GREEDY)
        a.runner.kv_connector.disk_storage.flush()  # FIRST's file is on disk
        b = _engine(tiny_model, tmp_path)  # slot1, while a holds slot0
        out, tiers = run_once(b, [AGAIN])
    finally:
        a.shutdown()
    assert out == reference["again"] and tiers["disk"].hit_tokens == 2 * BLOCK
    # b wrote none of the blocks it found in a's slot (only its new ones), and deleted none of a's files.
    assert {os.path.basename(os.path.dirname(p)) for p in _files(tmp_path)} == {"slot0", "slot1"}
    assert len([p for p in _files(tmp_path) if os.path.basename(os.path.dirname(p)) == "slot0"]) == 1


def test_a_file_of_another_slot_that_went_is_computed_instead(tiny_model, reference, tmp_path):
    a = _engine(tiny_model, tmp_path)
    try:
        _run(a, [FIRST], GREEDY)
        a.runner.kv_connector.disk_storage.flush()
        b = _engine(tiny_model, tmp_path)  # reads slot0's header now
        (a_file,) = _files(tmp_path)
        os.unlink(a_file)  # its owner evicted it
        out, tiers = run_once(b, [AGAIN])
    finally:
        a.shutdown()
    assert out == reference["again"]
    assert tiers["disk"].failed_blocks >= 1 and tiers["disk"].hit_tokens == 2 * BLOCK  # offered, then computed


def test_two_salts_never_share_a_disk_block(tiny_model, tmp_path):
    engine = _engine(tiny_model, tmp_path)
    try:
        _run(engine, [FIRST, *WORKLOAD[1:5]], GREEDY, salt="tenant-a")  # FIRST on disk, gone from the pool
        _run(engine, [AGAIN], GREEDY, salt="tenant-b")
        assert engine.kv_tier_stats()["disk"].hit_tokens == 0
        _run(engine, [AGAIN], GREEDY, salt="tenant-a")
        assert engine.kv_tier_stats()["disk"].hit_tokens == 2 * BLOCK
    finally:
        engine.shutdown()


def test_disk_settings_are_checked(tiny_model, tmp_path):
    with pytest.raises(ValueError, match="must be an absolute path"):
        LLMEngine(model=tiny_model, kv_offload_disk_path="relative/kv")
    with pytest.raises(ValueError, match="kv_offload_disk_bytes must be an integer"):
        LLMEngine(model=tiny_model, kv_offload_disk_path=str(tmp_path), kv_offload_disk_bytes=-5)
    with pytest.raises(ValueError, match="holds no block"):
        LLMEngine(model=tiny_model, num_kv_blocks=8, kv_offload_disk_path=str(tmp_path), kv_offload_disk_bytes=10)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_file_gives_back_its_blocks_as_stored(tmp_path, dtype):
    """DiskTierStorage alone: blocks written from a cache and read into another, in the tier's dtype."""
    import torch

    from shoal.workers.kv_transfer.disk_tier import DiskTierStorage

    g = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 3, 6, BLOCK, 2, 8, generator=g)  # [2, layers, blocks, block size, kv heads, head dim]
    storage = DiskTierStorage((2, 3, BLOCK, 2, 8), getattr(torch, dtype))
    path, keys = str(tmp_path / "f.kv"), [bytes([i]) * 32 for i in range(3)]
    try:
        storage.save(kv, path, [4, 1, 5], keys)
        storage.flush()
        back = torch.zeros_like(kv)
        assert all(storage.load(back, path, i, keys[i], b) for i, b in enumerate([0, 2, 3]))
        assert not storage.load(back, path, 0, keys[1], 0)  # another key at that index: refused
    finally:
        storage.shutdown()
    stored = kv.to(getattr(torch, dtype)).float()
    for src, dst in ((4, 0), (1, 2), (5, 3)):
        assert torch.equal(back[:, :, dst], stored[:, :, src])


@pytest.mark.parametrize("refused", [False, True], ids=["o_direct", "refused"])
def test_files_are_written_past_the_page_cache_where_the_file_system_allows(tmp_path, monkeypatch, refused):
    """Blocks of whole pages are written with O_DIRECT from page-aligned
    staging; where the file system refuses it (EINVAL, as tmpfs), buffered
    from then on; either way the file reads back as stored."""
    import errno
    import os

    import torch

    from shoal.workers.kv_transfer import disk_tier

    if refused:
        real_open = os.open

        def no_direct(path, flags, *a):
            if flags & getattr(os, "O_DIRECT", 0):
                raise OSError(errno.EINVAL, "O_DIRECT refused (test)")
            return real_open(path, flags, *a)

        monkeypatch.setattr(disk_tier.os, "open", no_direct)
    shape = (2, 4, BLOCK, 2, 16)  # 16 KiB a block in float32: whole pages
    kv = torch.randn(2, 4, 5, BLOCK, 2, 16, generator=torch.Generator().manual_seed(3))
    storage = disk_tier.DiskTierStorage(shape, torch.float32)
    assert storage.direct
    path, keys = str(tmp_path / "f.kv"), [bytes([i]) * 32 for i in range(3)]
    try:
        storage.save(kv, path, [3, 0, 4], keys)
        storage.flush()
        assert [b.data_ptr() % disk_tier.PAGE for b in storage._spare] == [0]  # staged on a page, kept for reuse
        back = torch.zeros_like(kv)
        assert all(storage.load(back, path, i, keys[i], b) for i, b in enumerate([1, 2, 0]))
    finally:
        storage.shutdown()
    for src, dst in ((3, 1), (0, 2), (4, 0)):
        assert torch.equal(back[:, :, dst], kv[:, :, src])
    assert storage.write_errors == 0 and os.stat(path).st_mode & 0o777 == 0o600
    if refused:
        assert not storage.direct  # buffered from now on
    else:  # kept on where this file system takes it
        try:
            os.close(os.open(str(tmp_path / "probe"), os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0)))
            assert storage.direct
        except OSError:
            assert not storage.direct


def test_the_writer_reuses_its_buffers_bounds_what_waits_and_outlives_a_failed_write(tmp_path, monkeypatch):
    """A save waits once too much is unwritten; a written file's staging buffer
    serves the next save; a write that raises leaves the writer running."""
    import threading

    import torch

    from shoal.workers.kv_transfer import disk_tier

    kv = torch.randn(2, 3, 6, BLOCK, 2, 8)
    storage = disk_tier.DiskTierStorage((2, 3, BLOCK, 2, 8), torch.float32)
    block_bytes = storage.block_bytes
    monkeypatch.setattr(disk_tier, "MAX_PENDING_BYTES", 2 * block_bytes)  # two blocks may wait
    real_header, gate, calls = disk_tier._header, threading.Event(), []

    def held_header(*a):  # the writer stops here until the gate opens; the first call fails
        calls.append(a)
        gate.wait()
        if len(calls) == 1:
            raise RuntimeError("injected")
        return real_header(*a)

    monkeypatch.setattr(disk_tier, "_header", held_header)
    keys = [[bytes([f, i]) * 16 for i in range(2)] for f in range(3)]
    try:
        storage.save(kv, str(tmp_path / "a.kv"), [0, 1], keys[0])  # two blocks: the bound is reached
        third = threading.Thread(target=storage.save, args=(kv, str(tmp_path / "b.kv"), [2, 3], keys[1]))
        third.start()
        third.join(0.2)
        assert third.is_alive()  # waiting for the writer, which the gate holds
        gate.set()
        third.join()
        storage.flush()
        assert storage.write_errors == 1 and not (tmp_path / "a.kv").exists()  # failed, and the writer lives on
        assert (tmp_path / "b.kv").exists()
        spare = list(storage._spare)
        assert spare and storage._pending_bytes == 0
        storage.save(kv, str(tmp_path / "c.kv"), [4, 5], keys[2])  # a buffer written out serves again
        assert any(storage._pending[str(tmp_path / "c.kv")][2] is b for b in spare)
        storage.flush()
        back = torch.zeros_like(kv)
        assert storage.load(back, str(tmp_path / "c.kv"), 1, keys[2][1], 0) and torch.equal(back[:, :, 0], kv[:, :, 5])
    finally:
        gate.set()
        storage.shutdown()
