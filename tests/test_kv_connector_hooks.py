"""The parts of vLLM's KVConnectorBase_V1 shape that no built-in connector
uses: the per-layer hooks (wait_for_layer_load, save_kv_layer) and a
request_finished that keeps an ended request's blocks until its worker side
says they are sent. A connector of the test's own, chosen by --kv-connector
package.module:ClassName as a user's would be."""

from __future__ import annotations

import pytest

from shoal.proto.messages import GenerateRequest
from shoal.workers import LLMEngine, SamplingParams
from shoal.workers.core.outputs import KVConnectorOutput
from shoal.workers.kv_transfer.base import KVConnectorBase, KVConnectorMetadata

PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
PROMPT = list(range(3, 43))  # 40 tokens: 2 full blocks of 16 and a part


class _Nothing(KVConnectorMetadata):
    @property
    def is_empty(self) -> bool:
        return True


class RecordingConnector(KVConnectorBase):
    """Records every worker-side call; keeps the blocks of requests in `hold`
    until the test puts them in `sent`. Class attributes: the engine makes
    one instance for each side, and the test reads both."""

    calls: list[tuple[str, str]] = []
    hold: set[str] = set()
    sent: set[str] = set()

    def get_num_new_matched_tokens(self, seq, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, seq, block_ids, num_external_tokens):
        return None

    def build_connector_meta(self, scheduler_output):
        return _Nothing()

    def request_finished(self, seq, block_ids):
        if seq.request_id in self.hold:
            return True, {"remote_block_ids": list(block_ids)}
        return False, None

    def start_load_kv(self, metadata):
        self.calls.append(("start_load_kv", ""))

    def wait_for_layer_load(self, layer_name):
        self.calls.append(("wait_for_layer_load", layer_name))

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata):
        k, v = kv_layer
        assert k.shape == v.shape and k.shape[1] == 16  # [blocks, block_size, kv_heads, head_dim]
        # The step's keys are in place: its slots hold what the layer just wrote (nonzero).
        assert k.reshape(-1, *k.shape[2:])[attn_metadata.slot_mapping].abs().sum() > 0
        self.calls.append(("save_kv_layer", layer_name))

    def get_finished(self, timeout_s: float = 0.0):
        if not RecordingConnector.sent:
            return None
        out = KVConnectorOutput(finished_sending=set(RecordingConnector.sent))
        RecordingConnector.sent.clear()
        return out


@pytest.fixture
def recording():
    RecordingConnector.calls, RecordingConnector.hold, RecordingConnector.sent = [], set(), set()
    yield RecordingConnector
    RecordingConnector.calls = []


def _engine(model: str, **kw) -> LLMEngine:
    return LLMEngine(model=model, num_kv_blocks=16, num_threads=1, **kw)


def _run(engine: LLMEngine, rid: str) -> list[int]:
    engine.add_request(GenerateRequest(rid, list(PROMPT), PARAMS))
    tokens: list[int] = []
    while rid in engine.requests:
        for d in engine.step():
            tokens += d.new_token_ids
    return tokens


def test_every_attention_layer_calls_the_hooks_around_itself_each_step(tiny_model, recording):
    plain = _engine(tiny_model)
    try:
        reference = _run(plain, "r")
    finally:
        plain.shutdown()
    engine = _engine(tiny_model, kv_connector=f"{__name__}:RecordingConnector")
    try:
        assert engine.runner.kv_connector.uses_layer_hooks
        assert _run(engine, "r") == reference  # (the hooks run outside the fused CPU decode step)
        layers = [a.layer_name for a in engine.runner.model.attention_layers()]
    finally:
        engine.shutdown()
    assert len(set(layers)) == len(layers) == 2 and all(name.endswith("attn") for name in layers)
    # One prefill and two decodes: each loads first, then each layer waits for its load and saves.
    per_step = [("start_load_kv", "")] + [
        (hook, n) for n in layers for hook in ("wait_for_layer_load", "save_kv_layer")
    ]
    assert recording.calls == per_step * len(reference)


def test_blocks_a_send_still_reads_are_freed_when_it_is_done(tiny_model, recording):
    recording.hold = {"held"}
    engine = _engine(tiny_model, kv_connector=f"{__name__}:RecordingConnector")
    try:
        total = engine.block_manager.num_free_blocks
        _run(engine, "freed")
        assert engine.block_manager.num_free_blocks == total  # an ordinary end frees at once
        _run(engine, "held")
        held = engine.scheduler.sending["held"]
        assert held.kv_transfer_params == {"remote_block_ids": held.block_table}
        assert engine.block_manager.num_free_blocks == total - len(held.block_table) == total - 3
        assert engine.has_unfinished_requests()  # its steps go on polling for the send's end
        engine.step()
        assert engine.block_manager.num_free_blocks < total  # not sent yet
        recording.sent.add("held")
        engine.step()
        assert engine.block_manager.num_free_blocks == total and not engine.scheduler.sending
        assert not engine.has_unfinished_requests()
    finally:
        engine.shutdown()


def test_the_offloading_connector_has_no_layer_hooks_so_keeps_the_fast_paths(tiny_model):
    engine = _engine(tiny_model, kv_offload_host_bytes=1 << 20)
    try:
        assert engine.runner.kv_connector is not None and not engine.runner.kv_connector.uses_layer_hooks
    finally:
        engine.shutdown()
