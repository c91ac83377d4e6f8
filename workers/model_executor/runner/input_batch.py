"""The block tables of the sequences a model runner has seen lately, kept
as rows of one array across steps (vLLM's InputBatch / BlockTable).

A sequence's block table only ever grows, and a freed sequence gets a new
list (BlockManager.free), so a row mirrors one list object: each step
copies the few block ids appended since the last, not every row's table,
and a step's slot mapping and block tables are then array indexing over
its rows, with no Python work per token or per block.

Rows are keyed by the list's identity and hold a reference to it, so an id
is never reused while its row lives. Rows not in the current step are
reclaimed when the array runs out; the array grows when a step needs more
rows or wider tables than it has.
"""

from __future__ import annotations

import numpy as np


class InputBatch:
    def __init__(self, max_blocks_per_seq: int, capacity: int = 64):
        # As wide as the longest table seen (up to max_blocks_per_seq from the start): a long
        # max_model_len costs memory only once some sequence is that long.
        self.block_table = np.zeros((max(1, capacity), max(1, min(max_blocks_per_seq, 64))), dtype=np.int64)
        capacity = self.block_table.shape[0]
        self.num_blocks = np.zeros(capacity, dtype=np.int64)  # each row's valid prefix
        self._tables: list[list[int] | None] = [None] * capacity  # the list each row mirrors
        self._row_of: dict[int, int] = {}  # id(list) -> row
        self._last_step = [0] * capacity
        self._free = list(range(capacity - 1, -1, -1))
        self._step = 0

    @property
    def num_rows(self) -> int:
        """Rows holding a table (tests check that rows are reclaimed)."""
        return len(self._row_of)

    def rows_for(self, tables: list[list[int]]) -> np.ndarray:
        """The rows mirroring these block tables (one step's, in its order),
        brought up to date: int64 [len(tables)]."""
        self._step += 1
        step = self._step
        out = np.empty(len(tables), dtype=np.int64)
        row_of, num_blocks = self._row_of, self.num_blocks
        for i, table in enumerate(tables):
            row = row_of.get(id(table))
            if row is None:
                row = self._new_row(table)
                num_blocks = self.num_blocks  # a new row may have grown the arrays
            n, m = int(num_blocks[row]), len(table)
            if m != n:
                self._sync(row, table, n, m)
            self._last_step[row] = step
            out[i] = row
        return out

    def gather(self, rows: np.ndarray, width: int) -> np.ndarray:
        """int64 [len(rows), width]: the rows' first `width` block ids, 0 past a table's end."""
        if width > self.block_table.shape[1]:
            self._widen(width)
        return self.block_table[rows, :width]

    def slots(self, rows: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
        """The KV cache slot of each (row, position): rows and positions int64, one per token."""
        index, offset = np.divmod(positions, block_size)
        past = index >= self.num_blocks[rows]  # would read a stale id: another sequence's cache
        if past.any():
            raise IndexError(f"position {int(positions[np.argmax(past)])} is past its sequence's blocks")
        return self.block_table[rows, index] * block_size + offset

    # ---- rows ------------------------------------------------------------

    def _new_row(self, table: list[int]) -> int:
        if not self._free:
            self._reclaim()
        row = self._free.pop()
        self._tables[row] = table
        self._row_of[id(table)] = row
        self.num_blocks[row] = 0
        return row

    def _sync(self, row: int, table: list[int], n: int, m: int) -> None:
        if m > self.block_table.shape[1]:
            self._widen(m)
        if m < n:  # tables only grow; a shorter one is rewritten whole
            self.block_table[row, m:n] = 0
            n = 0
        self.block_table[row, n:m] = table[n:m]
        self.num_blocks[row] = m

    def _reclaim(self) -> None:
        """Free every row not in the current step, or grow when all are."""
        for row, table in enumerate(self._tables):
            if table is not None and self._last_step[row] < self._step:
                del self._row_of[id(table)]
                self._tables[row] = None
                self.block_table[row, : self.num_blocks[row]] = 0
                self.num_blocks[row] = 0
                self._free.append(row)
        if not self._free:
            old = len(self._tables)
            self.block_table = np.concatenate([self.block_table, np.zeros_like(self.block_table)])
            self.num_blocks = np.concatenate([self.num_blocks, np.zeros_like(self.num_blocks)])
            self._tables += [None] * old
            self._last_step += [0] * old
            self._free = list(range(2 * old - 1, old - 1, -1))

    def _widen(self, width: int) -> None:
        rows, old = self.block_table.shape
        wider = np.zeros((rows, max(width, 2 * old)), dtype=np.int64)
        wider[:, :old] = self.block_table
        self.block_table = wider
