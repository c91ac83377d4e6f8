"""What the scheduler asks of a KV connector's scheduler side: the methods
it calls, so that core/ knows no connector (kv_transfer/base.py implements it)."""

from __future__ import annotations

from typing import Any, Protocol

from shoal.workers.core.outputs import KVConnectorOutput
from shoal.workers.core.sequence import Sequence


class SchedulerConnector(Protocol):
    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> tuple[int | None, bool]: ...

    def update_state_after_alloc(self, seq: Sequence, block_ids: list[int], num_external_tokens: int) -> None: ...

    def build_connector_meta(self, scheduler_output: Any) -> Any: ...

    def on_block_evicted(self, block_id: int, block_hash: bytes) -> None: ...

    def request_finished(self, seq: Sequence, block_ids: list[int]) -> tuple[bool, dict | None]: ...

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None: ...
