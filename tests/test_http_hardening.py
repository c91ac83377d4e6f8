"""The HTTP front against hostile bodies and browsers: strict JSON (NaN,
overflow, deep nesting, bad UTF-8, lone surrogates), the Content-Type check,
the status page's CSP and frame ban, and the Host allowlist. Each refusal is
a 4xx naming the field or the problem; the worker keeps serving."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from serving import http_client, make_frontend

from shoal.router.fronts import strict_json
from shoal.router.fronts.frontend import ServingError
from shoal.router.fronts.http_guards import LOOPBACK, host_allowlist
from shoal.router.fronts.openai_app import OpenAIApp

JSON = {"Content-Type": "application/json"}
GOOD = {"prompt": "The quick brown fox", "max_tokens": 2}


def _deep(n: int) -> bytes:
    """A body nested n levels deep (the outer object is level 1)."""
    return b'{"prompt": ' + b"[" * (n - 1) + b"]" * (n - 1) + b"}"


# (raw body, status, the error's param, a word of its message)
BAD_BODIES = [
    (b'{"prompt": "hi", "max_tokens": 4, "temperature": NaN}', 400, "temperature", "finite"),
    (b'{"prompt": "hi", "max_tokens": 4, "temperature": Infinity}', 400, "temperature", "finite"),
    (b'{"prompt": "hi", "max_tokens": 4, "temperature": -Infinity}', 400, "temperature", "finite"),
    (b'{"prompt": "hi", "max_tokens": 4, "temperature": 1e400}', 400, "temperature", "finite"),
    (b'{"prompt": "hi", "max_tokens": 4, "temperature": 1' + b"0" * 400 + b"}", 400, "temperature", "finite"),
    (b'{"prompt": "hi", "max_tokens": -1' + b"0" * 400 + b"}", 400, "max_tokens", "finite"),
    (b'{"prompt": "hi", "max_tokens": 4, "logit_bias": {"5": NaN}}', 400, "logit_bias.5", "finite"),
    (b'{"prompt": "hi", "max_tokens": 4, "stop": ["a", [1, 2.5e999]]}', 400, "stop[1][1]", "finite"),
    (_deep(100_000), 400, None, "deeper than 64"),
    (_deep(65), 400, "prompt", "deeper than 64"),
    (b'{"prompt": "caf\xe9", "max_tokens": 4}', 400, None, "UTF-8"),
    (b'{"prompt": "\xff\xfe", "max_tokens": 4}', 400, None, "UTF-8"),
    (b'{"prompt": "a\\ud800b", "max_tokens": 4}', 400, "prompt", "surrogate"),
    (b'{"prompt": "hi", "max_tokens": 4, "stop": ["\\udfff"]}', 400, "stop[0]", "surrogate"),
    (b'{"prompt": "hi", "\\ud800": 1}', 400, "body", "surrogate"),
    (b"NaN", 400, None, "finite"),
    (b'{"prompt": "hi"', 400, None, "malformed JSON"),
]


@pytest.mark.parametrize("body,status,param,word", BAD_BODIES, ids=range(len(BAD_BODIES)))
def test_hostile_bodies_get_400_naming_the_problem_and_the_worker_keeps_serving(tiny_model, body, status, param, word):
    async def main():
        fe = make_frontend(tiny_model)
        async with http_client(fe) as c:
            bad = await c.post("/v1/completions", content=body, headers=JSON)
            chat = await c.post(
                "/v1/chat/completions", content=body.replace(b'"prompt": ', b'"messages": '), headers=JSON
            )
            good = await c.post("/v1/completions", json=GOOD)
        return bad, chat, good, fe

    bad, chat, good, fe = asyncio.run(main())
    assert bad.status_code == status, bad.text
    err = bad.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and word in err["message"], err
    assert chat.status_code == 400  # the same reader serves chat
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 2
    assert fe.pool.workers[0].engine.failed is None and fe.num_in_flight == 0


def test_nesting_of_64_levels_passes_the_reader_and_a_surrogate_pair_is_text(tiny_model):
    async def main():
        fe = make_frontend(tiny_model)
        async with http_client(fe) as c:
            deep = await c.post("/v1/completions", content=_deep(64), headers=JSON)
            emoji = await c.post(
                "/v1/completions", content=b'{"prompt": "smile \\ud83d\\ude00", "max_tokens": 2}', headers=JSON
            )
            large = await c.post(
                "/v1/completions", content=b'{"prompt": "hi", "max_tokens": 2, "temperature": 1e300}', headers=JSON
            )
        return deep, emoji, large

    deep, emoji, large = asyncio.run(main())
    # 64 levels is no nesting error: the prompt's own check refuses the shape.
    assert deep.status_code == 400 and "deeper" not in deep.json()["error"]["message"]
    assert deep.json()["error"]["param"] == "prompt"
    assert emoji.status_code == 200
    assert large.status_code in (200, 400)  # finite: the reader passes it, the sampling checks judge it
    if large.status_code == 400:
        assert large.json()["error"]["param"] == "temperature"


def _reader_error(body: bytes) -> tuple[str, str | None] | None:
    """strict_json's refusal of a body as (message, field), or None when it reads it."""
    try:
        strict_json.loads(body)
    except ServingError as e:
        return str(e), e.field
    return None


def test_the_reader_tells_strings_from_structure_and_checks_large_bodies_in_c(monkeypatch):
    # Brackets and quotes inside strings are text: an escaped quote does not end a string, an escaped backslash does.
    assert _reader_error(b'{"a": "\\\\\\"' + b"[" * 100 + b'", "b": ' + b"[" * 63 + b"]" * 63 + b"}") is None
    too_deep = _reader_error(b'{"a": "\\\\", "b": ' + b"[" * 64 + b"]" * 64 + b"}")
    assert too_deep == ("the JSON body nests deeper than 64 levels", "b")
    assert _reader_error(b'{"a": "\\\\ud800"}') is None  # an escaped backslash, then text: no surrogate
    assert _reader_error(b'{"a": [' + b"1" + b"0" * 308 + b"]}") is None  # 1e308: 309 digits, finite
    assert _reader_error(b'{"a": "' + b"9" * 400 + b'"}') is None  # digits in a string are text
    assert _reader_error(b'{"a": 1' + b"0" * 400 + b"e-300}") is None  # a float that fits
    # Too many arrays and objects (here the empty ones, the list and the body): refused before json builds them.
    many = json.dumps({"prompt": [{}] * (strict_json.MAX_CONTAINERS + 1)}).encode()
    assert _reader_error(many) == (
        f"the JSON body holds {strict_json.MAX_CONTAINERS + 3} arrays and objects, over 65536",
        None,
    )
    # A problem past the walk's budget is refused without its field's name.
    monkeypatch.setattr(strict_json, "WALK_BUDGET", 100)
    late = [[k] for k in range(200)]
    for value, word in ((b"NaN", "finite"), (b'"\\udc00"', "surrogate"), (b"-1" + b"0" * 400, "finite")):
        body = json.dumps({"prompt": late}).encode()[:-2] + b", " + value + b"]}"
        message, field = _reader_error(body)
        assert word in message and field is None, (value, message)
    near = b'{"prompt": [NaN, ' + json.dumps(late).encode()[1:] + b"}"
    assert _reader_error(near) == ("prompt[0]: NaN is not a finite number", "prompt[0]")
    # Both at once: the first the walk meets is named.
    both = _reader_error(b'{"a": NaN, "b": "\\ud800"}')
    assert both is not None and both[1] in ("a", "b")


@pytest.mark.parametrize(
    "content_type,status",
    [
        (None, 415),
        ("text/plain", 415),
        ("application/x-www-form-urlencoded", 415),
        ("application/jsonx", 415),
        ("application/json; charset=latin-1", 415),
        ("application/json", 200),
        ("Application/JSON; charset=UTF-8", 200),
    ],
)
def test_posts_need_content_type_application_json(tiny_model, content_type, status):
    async def main():
        fe = make_frontend(tiny_model)
        async with http_client(fe) as c:
            headers = {"Content-Type": content_type} if content_type else {}
            return await c.post("/v1/completions", content=json.dumps(GOOD).encode(), headers=headers)

    r = asyncio.run(main())
    assert r.status_code == status, r.text
    if status == 415:
        err = r.json()["error"]
        assert err["code"] == "unsupported_media_type" and "application/json" in err["message"]


def test_status_page_sends_csp_and_refuses_framing(tiny_model):
    async def main():
        fe = make_frontend(tiny_model)
        async with http_client(fe) as c:
            return [await c.get(p) for p in ("/", "/api/status", "/api/auth")]

    for r in asyncio.run(main()):
        assert r.status_code == 200
        csp = [d.strip() for d in r.headers["content-security-policy"].split(";")]
        assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp
        assert r.headers["x-frame-options"] == "DENY" and r.headers["x-content-type-options"] == "nosniff"


def test_allowed_hosts_rule():
    assert host_allowlist(None, None) == LOOPBACK  # a local `shoal serve` without a key: loopback names only
    assert host_allowlist(None, "sekret") is None  # a key guards it: any Host
    assert host_allowlist("*", None) is None
    assert host_allowlist(" API.example.com , *.svc.cluster.local,", None) == ("api.example.com", "*.svc.cluster.local")


@pytest.mark.parametrize(
    "allowed,host,ok",
    [
        (None, "localhost:8000", True),
        (None, "127.0.0.1", True),
        (None, "[::1]:8000", True),
        (None, "LOCALHOST", True),
        (None, "evil.example", False),
        (None, "localhost.evil.example", False),
        (None, "evil.example:8000", False),
        (None, "127.0.0.1.nip.io", False),
        (None, "", False),
        ("api.example.com,*.svc.cluster.local", "api.example.com:443", True),
        ("api.example.com,*.svc.cluster.local", "shoal.ns.svc.cluster.local", True),
        ("api.example.com,*.svc.cluster.local", "localhost", False),
        ("api.example.com,*.svc.cluster.local", "xapi.example.com", False),
    ],
)
def test_host_header_outside_the_allowlist_gets_400_but_health_stays_open(tiny_model, allowed, host, ok):
    async def main():
        fe = make_frontend(tiny_model)
        app = OpenAIApp(fe, 1 << 20, allowed_hosts=host_allowlist(allowed, None)).app
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x") as c:
            h = {"Host": host}
            return (
                await c.post("/v1/completions", json=GOOD, headers=h),
                await c.get("/", headers=h),
                await c.get("/health", headers=h),
                await c.get("/metrics", headers=h),
            )

    api, page, health, metrics = asyncio.run(main())
    assert (api.status_code, page.status_code) == ((200, 200) if ok else (400, 400)), api.text
    if not ok:
        assert api.json()["error"]["code"] == "invalid_host"
    assert health.status_code == 200 and metrics.status_code == 200  # probes and scrapers call by the pod's address
