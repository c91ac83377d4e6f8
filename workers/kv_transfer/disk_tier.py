"""The disk tier: KV blocks in files under --kv-offload-disk-path, found
again by a restarted engine with the same settings.

A file holds a group of blocks: those of one finished request that the tier
did not hold yet. It is named by its first block's key and begins with a
header (magic, then JSON: the keys, each block's CRC-32, the block's bytes
and dtype), padded to a page; the blocks follow, each one contiguous across
layers. Files are written by one writer thread, off the step, to a
temporary name (mode 0600, in a 0700 folder) and renamed once complete, so
a file that exists is whole; they are read through mmap, and a block whose
key or checksum does not match is a failed load (KVLoadError), computed
instead.

Under tensor parallelism each rank writes its heads' slice of a file to
<file>.rank<k> beside rank 0's (rank_path), and the ranks agree on each
step's loads before its forward (offloading.py).

The folder holds one subfolder per engine fingerprint (keys.py) and storage
dtype, so engines with other weights or settings never read each other's
files. Inside it each engine writes a slot of its own (two sharing one
would delete each other's files as they evict), but reads every slot: a
pod's workers, restarted, take whichever slots come free, and each finds
the blocks all of them wrote. A file in another slot is never written or
deleted here; its owner may delete it, and a load of it then fails, and is
computed. The scheduler side's DiskTierIndex knows which key lies in which
file (read from the headers at start, then kept as its own files are
written and deleted), and evicts its own files, least recently used first,
past --kv-offload-disk-bytes. The worker side's DiskTierStorage writes,
reads and deletes them.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import mmap
import os
import queue
import threading
import zlib
from collections import OrderedDict
from dataclasses import dataclass

import torch

from shoal.workers.kv_transfer.host_memory import host_empty

logger = logging.getLogger(__name__)

MAGIC = b"SHOALKV1"
PAGE = 4096
SUFFIX = ".kv"


MAX_SLOTS = 64  # engines of one fingerprint sharing a disk path (a pod's workers)


_BITS = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8}  # dtypes numpy lacks, as integers


def tier_folder(root: str, fingerprint: bytes, dtype: torch.dtype) -> str:
    """Where engines of this fingerprint, storing blocks in dtype, keep their slots."""
    return os.path.join(root, f"{fingerprint.hex()[:32]}-{str(dtype).removeprefix('torch.')}")


def rank_path(path: str, rank: int) -> str:
    """Where tensor-parallel rank `rank` keeps its heads' slice of the file at
    path (the scheduler side's index names rank 0's): beside it, in the same
    slot, and never taken for a file of the index's own (SUFFIX)."""
    return path if rank == 0 else f"{path}.rank{rank}"


def claim_slot(folder: str) -> tuple[str, int]:
    """The first slot folder (folder/slot<k>) no running engine holds, and the
    open lock file that holds it (flock: released when the engine ends, even
    killed). Engines sharing a disk path so never share files, and a
    restarted engine takes a slot that a previous one filled."""
    for k in range(MAX_SLOTS):
        slot = os.path.join(folder, f"slot{k}")
        os.makedirs(slot, mode=0o700, exist_ok=True)
        fd = os.open(os.path.join(slot, ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return slot, fd
    raise ValueError(f"kv_offload_disk_path: all {MAX_SLOTS} slots under {folder} are held by running engines")


def _header(keys: list[bytes], crcs: list[int], block_bytes: int, dtype: torch.dtype) -> bytes:
    meta = {"keys": [k.hex() for k in keys], "crc32": crcs, "block_bytes": block_bytes, "dtype": str(dtype)}
    body = json.dumps(meta, separators=(",", ":")).encode()
    head = MAGIC + len(body).to_bytes(4, "little") + body
    return head + b"\0" * (-len(head) % PAGE)


def file_bytes(num_blocks: int, block_bytes: int, dtype: torch.dtype) -> int:
    """A file's size: its header (the keys' hex and checksums bound it) and its blocks."""
    return (
        len(_header([bytes(32)] * num_blocks, [2**32 - 1] * num_blocks, block_bytes, dtype)) + num_blocks * block_bytes
    )


def read_header(path: str) -> tuple[dict, int] | None:
    """(the header's fields, the data's offset), or None for a file that is not one of ours."""
    try:
        with open(path, "rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                return None
            n = int.from_bytes(f.read(4), "little")
            if n > 1 << 24:
                return None
            meta = json.loads(f.read(n))
    except (OSError, ValueError):
        return None
    offset = len(MAGIC) + 4 + n
    return meta, offset + (-offset % PAGE)


@dataclass(slots=True)
class DiskFile:
    keys: list[bytes]
    size: int


class DiskTierIndex:
    """Which file holds each key; files least recently used first."""

    def __init__(self, folder: str, capacity_bytes: int, block_bytes: int, dtype: torch.dtype):
        self.folder, fd = claim_slot(folder)
        self._lock_fd: int | None = fd
        self.capacity_bytes = capacity_bytes
        self.block_bytes = block_bytes
        self.files: OrderedDict[str, DiskFile] = OrderedDict()  # name -> file, least recently used first
        self.where: dict[bytes, tuple[str, int]] = {}  # key -> (file name, index in it)
        self.used_bytes = 0
        self.pinned: set[str] = set()  # files this step's loads read: never deleted in the same step
        self.num_evicted_blocks = 0
        self.evicted: list[bytes] = []  # keys of files evicted since the owner last took them (and cleared this)
        # key -> (absolute path, index): blocks in other slots' files, as their headers said at start
        self.foreign: dict[bytes, tuple[str, int]] = {}
        self._scan(str(dtype))
        self._scan_other_slots(str(dtype))

    def _scan(self, dtype: str) -> None:
        """The files a previous engine with this fingerprint left in the slot, oldest first."""
        found = []
        for name in os.listdir(self.folder):
            path = os.path.join(self.folder, name)
            if not name.endswith(SUFFIX):
                if name.endswith(".tmp"):  # a write cut short (the slot's last engine is gone): never read
                    os.unlink(path)
                continue
            got = read_header(path)
            meta = got[0] if got is not None else None
            if meta is None or meta.get("block_bytes") != self.block_bytes or meta.get("dtype") != dtype:
                logger.warning("KV disk tier: %s is not a file of this engine's; removed", path)
                os.unlink(path)
                continue
            found.append((os.path.getmtime(path), name, [bytes.fromhex(k) for k in meta["keys"]]))
        for _, name, keys in sorted(found):
            self._add(name, keys, os.path.getsize(os.path.join(self.folder, name)))
        for name in os.listdir(self.folder):  # other ranks' slices of files gone: their blocks are lost
            base, dot, rank = name.rpartition(".rank")
            if dot and rank.isdigit() and base not in self.files:
                os.unlink(os.path.join(self.folder, name))

    def _scan_other_slots(self, dtype: str) -> None:
        """The files of the other slots beside this one (read, never written or deleted here)."""
        parent = os.path.dirname(self.folder)
        for slot in sorted(os.listdir(parent)):
            folder = os.path.join(parent, slot)
            if folder == self.folder or not os.path.isdir(folder):
                continue
            for name in sorted(os.listdir(folder)):
                path = os.path.join(folder, name)
                got = read_header(path) if name.endswith(SUFFIX) else None
                meta = got[0] if got is not None else None
                if meta is None or meta.get("block_bytes") != self.block_bytes or meta.get("dtype") != dtype:
                    continue
                for i, key in enumerate(bytes.fromhex(k) for k in meta["keys"]):
                    if key not in self.where:
                        self.foreign.setdefault(key, (path, i))

    def _add(self, name: str, keys: list[bytes], size: int) -> None:
        self.files[name] = DiskFile(keys, size)
        for i, key in enumerate(keys):
            self.where.setdefault(key, (name, i))
        self.used_bytes += size

    def __contains__(self, key: bytes) -> bool:
        return key in self.where or key in self.foreign

    def __len__(self) -> int:
        return len(self.where)  # this slot's: the others' count in their engines'

    def locate(self, key: bytes) -> tuple[str, int]:
        """(file name, or another slot's file's absolute path; the block's index in it)."""
        return self.where.get(key) or self.foreign[key]

    def owns(self, name: str) -> bool:
        return name in self.files

    def pin(self, key: bytes) -> tuple[str, int]:
        name, i = self.locate(key)
        if name in self.files:
            self.files.move_to_end(name)
            self.pinned.add(name)
        return name, i

    def unpin_all(self) -> None:
        self.pinned.clear()

    def path(self, name: str) -> str:
        return os.path.join(self.folder, name)  # another slot's absolute path stays as it is

    def release(self) -> None:
        """Let go of the slot (the engine is shutting down)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def add(self, keys: list[bytes], dtype: torch.dtype) -> tuple[str, list[str]]:
        """A new file for keys (none held yet): its name, and the files to
        delete (least recently used, unpinned) so the tier stays within its bytes."""
        name = f"{keys[0].hex()[:32]}-{os.urandom(4).hex()}{SUFFIX}"  # unique: a name is never reused
        size = file_bytes(len(keys), self.block_bytes, dtype)
        deleted = []
        while self.files and self.used_bytes + size > self.capacity_bytes:
            victim = next((n for n in self.files if n not in self.pinned), None)
            if victim is None:
                break
            deleted.append(victim)
            self.evicted += self.files[victim].keys
            self.num_evicted_blocks += self.forget(victim)
        self._add(name, keys, size)
        return name, deleted

    def forget(self, name: str) -> int:
        """The file is gone (evicted, or its contents proved bad); returns its
        blocks (0 for another slot's file, whose entries go, and the file stays)."""
        if os.path.isabs(name):
            for key in [k for k, (path, _) in self.foreign.items() if path == name]:
                del self.foreign[key]
            return 0
        f = self.files.pop(name, None)
        if f is None:
            return 0
        for i, key in enumerate(f.keys):
            if self.where.get(key) == (name, i):
                del self.where[key]
        self.used_bytes -= f.size
        return len(f.keys)


# Staging buffers (the blocks copied out of the pool, waiting for the writer) are
# kept for reuse, in sizes of STAGING_ROUND blocks, up to SPARE_STAGING_BYTES of
# them: fresh memory costs a page fault every 4 KiB, which on the CPU is 5-10x
# the copy itself. Past MAX_PENDING_BYTES not yet written, a save waits for the
# writer rather than let memory grow.
STAGING_ROUND = 64
SPARE_STAGING_BYTES = 512 << 20
MAX_PENDING_BYTES = 2 << 30
WRITER_NICE = 10  # the writer's niceness: about a tenth of a step thread's share of a core they both want
# Files are written with O_DIRECT where the folder's file system takes it: a buffered write
# allocates page-cache pages for every 4 KiB it writes, several times the CPU time of the
# write itself, on the cores the steps run on. The staging buffers are page-aligned for it
# (host_memory.py).


def _write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view) :]


class DiskTierStorage:
    """The worker side: writes on its own thread, reads through mmap; told
    every file by its path (the scheduler side's index owns the folder)."""

    def __init__(self, block_shape: tuple[int, ...], dtype: torch.dtype, rank: int = 0):
        self.rank = rank
        self.block_shape = block_shape
        self.dtype = dtype
        self.block_bytes = torch.Size(block_shape).numel() * dtype.itemsize
        # path -> (keys, the blocks, their staging buffer): written soon, loads read them here
        self._pending: dict[str, tuple[list[bytes], torch.Tensor, torch.Tensor]] = {}
        self._pending_bytes = 0
        self._spare: list[torch.Tensor] = []  # staging buffers written out, for the next saves
        self._lock = threading.Lock()
        self._written = threading.Condition(self._lock)
        self._ops: queue.SimpleQueue = queue.SimpleQueue()
        self.write_errors = 0
        self.direct = self.block_bytes % PAGE == 0  # O_DIRECT writes, until the file system refuses one
        self._writer = threading.Thread(target=self._write_loop, name="shoal-kv-disk-writer", daemon=True)
        self._writer.start()

    # ---- on the step's thread ----------------------------------------------

    def save(self, kv_cache: torch.Tensor, path: str, block_ids: list[int], keys: list[bytes]) -> None:
        """Copy the blocks out now (the pool may reuse them after this step); write them later."""
        path = rank_path(path, self.rank)
        staging = self._staging(len(block_ids))
        data = staging[: len(block_ids)]
        if kv_cache.device.type == "cpu":  # a copy a block, into memory already touched
            for i, b in enumerate(block_ids):
                data[i].copy_(kv_cache[:, :, b])
        else:
            blocks = kv_cache[:, :, torch.tensor(block_ids, device=kv_cache.device)]
            data.copy_(blocks.permute(2, 0, 1, 3, 4, 5))
        with self._lock:
            self._pending[path] = (keys, data, staging)
            self._pending_bytes += data.nbytes
        self._ops.put(("write", path))

    def _staging(self, n: int) -> torch.Tensor:
        """A buffer of at least n blocks: the smallest spare that fits, or a new one;
        first waiting, if too much is not yet written, for the writer to catch up."""
        with self._written:
            self._written.wait_for(lambda: self._pending_bytes < MAX_PENDING_BYTES)
            fits = [b for b in self._spare if b.shape[0] >= n]
            if fits:
                best = min(fits, key=lambda b: b.shape[0])
                self._spare = [b for b in self._spare if b is not best]
                return best
        return host_empty((-(-n // STAGING_ROUND) * STAGING_ROUND, *self.block_shape), self.dtype)

    def delete(self, path: str) -> None:
        self._ops.put(("delete", rank_path(path, self.rank)))

    def load(self, kv_cache: torch.Tensor, path: str, index: int, key: bytes, block_id: int) -> bool:
        """Block `index` of the file at path into the paged block; False (nothing
        written) if the file is gone, or its key or checksum does not match."""
        path = rank_path(path, self.rank)
        with self._lock:
            pending = self._pending.get(path)
        block: torch.Tensor | None
        if pending is not None:
            keys, data, _ = pending
            if index >= len(keys) or keys[index] != key:
                return False
            block = data[index]  # its buffer is reused only by a save, on this same thread
        else:
            block = self._read(path, index, key)
        if block is None:
            return False
        kv_cache[:, :, block_id] = block.to(kv_cache.device, kv_cache.dtype)
        return True

    def _read(self, path: str, index: int, key: bytes) -> torch.Tensor | None:
        got = read_header(path)
        if got is None:
            return None
        meta, offset = got
        keys = meta.get("keys", [])
        if index >= len(keys) or keys[index] != key.hex() or meta.get("block_bytes") != self.block_bytes:
            return None
        start = offset + index * self.block_bytes
        try:
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                if start + self.block_bytes > len(mm):
                    return None
                raw = mm[start : start + self.block_bytes]  # one copy out of the page cache
        except (OSError, ValueError):
            return None
        if zlib.crc32(raw) != meta["crc32"][index]:
            return None
        return torch.frombuffer(bytearray(raw), dtype=self.dtype).view(self.block_shape)

    def flush(self) -> None:
        """Wait until every write and delete asked so far is done."""
        done = threading.Event()
        self._ops.put(("flush", done))
        done.wait()

    def shutdown(self) -> None:
        self.flush()
        self._ops.put(None)
        self._writer.join()

    # ---- on the writer thread ----------------------------------------------

    def _write_loop(self) -> None:
        try:  # below the step's threads: they share the cores, and a step waits for its slowest thread
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        except (AttributeError, OSError):  # no per-thread priority here: written at the same priority
            pass
        while (op := self._ops.get()) is not None:
            kind, arg = op
            if kind == "flush":
                arg.set()
            elif kind == "delete":
                try:
                    os.unlink(arg)
                except FileNotFoundError:
                    pass
            else:
                try:
                    self._write(arg)
                except Exception:  # never lose the writer: saves would wait on it forever
                    self.write_errors += 1
                    logger.exception("KV disk tier: writing %s failed", arg)

    def _write_direct(self, tmp: str, header: bytes, data: torch.Tensor) -> bool:
        """The file at tmp written with O_DIRECT from page-aligned memory (the
        header copied into some; the blocks a whole number of pages, in their
        staging buffer); False, and buffered writes from now on, where the
        file system refuses it (tmpfs, some network file systems)."""
        aligned = mmap.mmap(-1, len(header))  # a page multiple (_header pads it), on a page
        aligned.write(header)
        fd = None
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o600)
            _write_all(fd, aligned)
            _write_all(fd, data.view(torch.uint8).reshape(-1).numpy())
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self.direct = False
            return False
        finally:
            if fd is not None:
                os.close(fd)
            aligned.close()
        return True

    def _write(self, path: str) -> None:
        with self._lock:
            keys, data, _ = self._pending[path]  # set before the op was queued; popped only here
        # Each block's bytes as they lie in the contiguous copy, with no copy of their own (numpy has no
        # bfloat16 or fp8: their bits as integers of their width).
        folder, base = os.path.split(path)
        tmp = os.path.join(folder, f".{base}.tmp")
        try:
            flat = data.view(_BITS.get(self.dtype, self.dtype))
            raw = [flat[i].numpy().data.cast("B") for i in range(len(keys))]
            os.makedirs(folder, mode=0o700, exist_ok=True)  # a rank on another node than the index's
            header = _header(keys, [zlib.crc32(b) for b in raw], self.block_bytes, self.dtype)
            if not (self.direct and self._write_direct(tmp, header, data)):
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(header)
                    for b in raw:
                        f.write(b)
            os.replace(tmp, path)
        except Exception as e:  # a full disk, or worse: the blocks are not on disk, and loads will say so
            self.write_errors += 1
            logger.warning("KV disk tier: writing %s failed: %s", path, e)
            try:
                os.unlink(tmp)
            except OSError:
                pass
        finally:
            with self._written:
                _, data, staging = self._pending.pop(path)
                self._pending_bytes -= data.nbytes
                spare = sum(b.nbytes for b in self._spare)
                if spare + staging.nbytes <= SPARE_STAGING_BYTES:
                    self._spare.append(staging)
                self._written.notify_all()
