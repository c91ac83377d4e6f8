"""Every HTTP endpoint fuzzed with schemathesis from the router's own
/openapi.json: bodies that fit the document and bodies that break it, a
bounded, derandomized number of each, over real TCP against the router's one
event loop with two in-process workers on a tiny model. No answer is a 5xx
or off the document (status, media type, body shape), no worker's engine
fails or is replaced, and /health, polled every 0.2 s meanwhile, answers 200
within 1 s every time. Run: pytest -m slow tests/test_fuzz_http.py"""

from __future__ import annotations

import collections
import logging
import os

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from live_router import KEY, HealthWatch, LiveRouter
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from shoal.router.fronts.openai_app import openapi_document

pytestmark = pytest.mark.slow
# Examples per operation and generation mode: about 500 requests, under a minute on two cores
# (SHOAL_FUZZ_SCALE=10 for a longer run before a release: the same examples and more).
MAX_EXAMPLES = 30 * int(os.environ.get("SHOAL_FUZZ_SCALE", "1"))
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def router(tiny_model, tmp_path_factory):
    # A short context: whatever max_tokens and prompts the fuzzer sends, each request ends quickly.
    # Runtime LoRA loads on, confined to an empty folder: every path the fuzzer names is refused.
    r = LiveRouter(tiny_model, max_model_len=64, lora_root=str(tmp_path_factory.mktemp("loras"))).start()
    yield r
    r.stop()


def test_every_endpoint_fuzzed_from_the_document_no_5xx_no_worker_lost_health_answers(router):
    # The key for the document's bearer scheme: schemathesis sends it, and leaves it out or spoils it to test auth.
    # Streams are read to their end (schemathesis stops at 20 events by default), so a cut one is seen.
    config = schemathesis.Config.from_str(f'max-stream-events = 1000000\n[auth.openapi.bearer]\nbearer = "{KEY}"\n')
    schema = schemathesis.openapi.from_url(f"{router.base}/openapi.json", config=config)
    operations = [result.ok() for result in schema.get_all_operations()]
    # Every endpoint but the document's own, which schemathesis leaves out (it just fetched it).
    assert {op.path for op in operations} == set(openapi_document()["paths"]) - {"/openapi.json"}
    statuses: collections.Counter = collections.Counter()
    session = requests.Session()
    logging.getLogger("shoal").setLevel(logging.ERROR)  # a refusal per example is the point here, not news

    with HealthWatch(f"{router.base}/health") as watch:
        for op in operations:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                if mode is GenerationMode.NEGATIVE and not len(op.body):
                    continue  # nothing to break without a body (/health's `all` is any string)

                @settings(
                    max_examples=MAX_EXAMPLES,
                    derandomize=True,
                    database=None,
                    deadline=None,
                    suppress_health_check=list(HealthCheck),
                )
                @given(case=op.as_strategy(generation_mode=mode))
                def fuzz(case):
                    response = case.call(base_url=router.base, session=session, timeout=60)
                    statuses[(op.path, response.status_code)] += 1
                    case.validate_response(response, checks=CHECKS)
                    if "text/event-stream" in str(response.headers.get("content-type")):  # a stream is never cut
                        assert response.text.endswith("data: [DONE]\n\n"), (case.body, response.text[-400:])

                fuzz()

    assert not router.engines_alive(), router.engines_alive()
    assert watch.answers and not watch.problems(), watch.problems()
    # The fuzzer reached past the refusals: requests ran on the engines too.
    assert statuses[("/v1/completions", 200)] and statuses[("/v1/chat/completions", 200)], statuses
    # The router serves a normal request after all that.
    r = session.post(f"{router.base}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=AUTH)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
