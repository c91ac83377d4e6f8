"""The OpenAI-compatible HTTP front (a Starlette app): /v1/completions,
/v1/chat/completions, /v1/models, /health, streamed as server-sent events,
and vLLM's /tokenize and /detokenize."""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, cast

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp

from shoal.proto.errors import InvalidRequestError
from shoal.proto.messages import GenerateDelta, RequestFinished
from shoal.router.fronts import openapi, parallel_sampling, request_schema, strict_json
from shoal.router.fronts.admission import sequences_field
from shoal.router.fronts.frontend import Frontend, ServingError
from shoal.router.fronts.http_guards import AdmissionLimit, HostCheck, until_disconnect
from shoal.router.fronts.openai_format import ChunkFormat, usage_so_far
from shoal.router.fronts.openai_protocol import (
    ParsedRequest,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_tokenize,
)
from shoal.router.fronts.stream_merge import merge_streams
from shoal.router.fronts.tool_parsers import TOOL_PARSERS, get_tool_parser
from shoal.router.fronts.tool_replies import ToolReplies
from shoal.router.observability import tracing
from shoal.router.observability.loop_monitor import REQUEST_TASK_PREFIX, name_task
from shoal.router.observability.status_page import StatusPage

logger = logging.getLogger(__name__)

# kind -> (HTTP status, OpenAI error type, code)
_ERRORS = {
    "invalid": (400, "invalid_request_error", None),
    "unauthenticated": (401, "authentication_error", "invalid_api_key"),
    "forbidden": (403, "permission_error", "forbidden"),
    "not_found": (404, "invalid_request_error", "model_not_found"),
    "conflict": (409, "invalid_request_error", "conflict"),
    "too_large": (413, "invalid_request_error", "request_too_large"),
    "media_type": (415, "invalid_request_error", "unsupported_media_type"),
    "timeout": (408, "invalid_request_error", "request_timeout"),
    "full": (429, "rate_limit_error", "server_full"),
    "unavailable": (503, "service_unavailable_error", "shutting_down"),
    "internal": (500, "internal_error", None),
}


def error_response(e: ServingError, headers: dict | None = None) -> JSONResponse:
    status, etype, code = _ERRORS.get(e.kind, _ERRORS["internal"])
    code = e.code or code
    if status == 408:  # the rest of the body may still come: the connection ends with this answer
        headers = {**(headers or {}), "Connection": "close"}
    return JSONResponse(
        {"error": {"message": e.message, "type": etype, "param": e.field, "code": code}}, status, headers
    )


# A body larger than this is decoded and parsed on the router's tokenizer pool: 1 MiB of
# JSON can hold a million objects, a second of Python work, which would hold the event loop.
OFF_LOOP_BYTES = 64 << 10


def _dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


class OpenAIApp:
    """Holds the Frontend; `app` is the ASGI application to serve."""

    def __init__(
        self,
        frontend: Frontend,
        max_request_bytes: int,
        status: StatusPage | None = None,
        max_concurrent_requests: int | None = None,
        allowed_hosts: tuple[str, ...] | None = None,
        tool_call_parser: str | None = None,
        body_timeout_s: float = 30.0,
    ):
        """max_concurrent_requests: past it 429 (None: no cap); allowed_hosts:
        the Host names answered (http_guards.host_allowlist; None: any);
        tool_call_parser: reads tool_choice auto replies (None: auto is refused);
        body_timeout_s: a request body not all in by then gets 408 (--http-body-timeout-s)."""
        if tool_call_parser is not None:
            get_tool_parser(tool_call_parser)  # an unknown name fails the start, not a request
        self.tool_call_parser = tool_call_parser
        self.fe = frontend
        self.max_request_bytes = max_request_bytes
        self.body_timeout_s = body_timeout_s
        status = status or StatusPage(frontend)
        self.app: ASGIApp
        self.app = self.starlette = Starlette(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"]),
                Route("/v1/load_lora_adapter", self.load_lora_adapter, methods=["POST"]),
                Route("/v1/unload_lora_adapter", self.unload_lora_adapter, methods=["POST"]),
                Route("/openapi.json", self.openapi, methods=["GET"]),  # public, as vLLM's
                *status.routes(self._denied),  # /metrics, the status page and its JSON
            ]
        )
        if max_concurrent_requests is not None:
            self.app = self.admission = AdmissionLimit(self.app, max_concurrent_requests)
        if allowed_hosts is not None:
            self.app = HostCheck(self.app, allowed_hosts)

    # ---- plumbing -----------------------------------------------------------

    def _authenticate(self, request: Request) -> None:
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        self.fe.authenticate(token.strip() if scheme.lower() == "bearer" else None)

    def _denied(self, request: Request) -> Response | None:
        try:
            self._authenticate(request)
        except ServingError as e:
            return error_response(e)
        return None

    async def _read_json(self, request: Request):
        media_type, _, params = request.headers.get("content-type", "").partition(";")
        charset = params.strip().lower().removeprefix("charset=").strip('"') if params.strip() else "utf-8"
        if media_type.strip().lower() != "application/json" or charset not in ("utf-8", "utf8"):
            raise ServingError(
                "media_type",
                "the body must be JSON sent as Content-Type: application/json "
                f"(UTF-8), not {request.headers.get('content-type')!r}",
            )
        limit = self.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ServingError("too_large", f"the request body exceeds {limit} bytes")
        chunks, size = [], 0
        try:  # a body sent slowly, or never finished, holds a connection and its buffer: a deadline
            async with asyncio.timeout(self.body_timeout_s):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise ServingError("too_large", f"the request body exceeds {limit} bytes")
                    chunks.append(chunk)
        except TimeoutError:
            raise ServingError(
                "timeout", f"the request body was not all received within {self.body_timeout_s:g} s"
            ) from None
        request.state.body_bytes = size
        if size <= OFF_LOOP_BYTES:
            return strict_json.loads(b"".join(chunks))
        return await self.fe.off_loop(strict_json.loads, b"".join(chunks))

    async def _start(
        self,
        request: Request,
        body,
        parse,
        rid: str,
        client_id: str | None,
        chat: bool,
    ) -> tuple[ParsedRequest, list[AsyncGenerator[GenerateDelta, None]], list[GenerateDelta]]:
        """Check and dispatch; wait for each choice's first delta so that a
        refusal (full, invalid) still gets its own status code. One choice's
        engine id is `rid`; several choices' (several prompts, n, best_of:
        parallel_sampling.py) are `rid-0`, `rid-1`, ..."""
        if getattr(request.state, "body_bytes", 0) > OFF_LOOP_BYTES:  # its fields are walked in Python
            parsed = await self.fe.off_loop(_parsed, parse, body)
        else:
            parsed = _parsed(parse, body)
        parsed.lora_name = await self.fe.lora.resolve_model(parsed.model)
        self._check_tool_choice(parsed)
        parallel_sampling.check(parsed, self.fe.limits.max_n, chat)
        if parsed.user is not None:  # %r: one log line whatever the client sent
            logger.info("request %s from user %r", rid, parsed.user)
        width = parallel_sampling.width(parsed)
        # Its sequences count against --max-concurrent-requests from here until its streams end.
        field = sequences_field(len(parsed.prompts), parsed.n, parsed.best_of)
        admitted = self.fe.admission.admit(len(parsed.prompts) * width, field)
        try:
            return await self._dispatch(request, parsed, rid, client_id, chat, width, admitted)
        finally:
            admitted.release_unclaimed()  # those of streams that never started (each started one gives its own back)

    async def _dispatch(
        self,
        request: Request,
        parsed: ParsedRequest,
        rid: str,
        client_id: str | None,
        chat: bool,
        width: int,
        admitted,
    ) -> tuple[ParsedRequest, list[AsyncGenerator[GenerateDelta, None]], list[GenerateDelta]]:
        """_start's work once the request's sequences are admitted."""
        rids = parallel_sampling.request_ids(rid, len(parsed.prompts) * width)
        # One trace span per engine request, each a child of the client's context.
        parent = tracing.context_from_headers(request.headers)
        op = "chat" if chat else "text_completion"
        spans = [self.fe.start_span(parent, op, r, client_id, parsed.stream, parsed.lora_name) for r in rids]
        try:
            prepared = [await self.fe.prepare(p, parsed.sampling, s) for p, s in zip(parsed.prompts, spans[::width])]
            # Within --max-tokens-per-request: the chat default shrinks, a chosen max_tokens must fit.
            prepared = self.fe.admission.fit_tokens(prepared, width, parsed.sampling.get("max_tokens") is not None)
            parsed.num_prompt_tokens = [len(ids) for ids, _ in prepared]
            if parsed.echo:  # a token-id prompt echoes as its text
                parsed.echo_texts = [
                    p.text if p.text is not None else await self.fe.detokenize(ids, "echo")
                    for p, (ids, _) in zip(parsed.prompts, prepared)
                ]
        except ServingError as e:
            for s in spans:
                tracing.fail_request_span(s, e)
            raise
        streams = [
            self.fe.generate(
                ids,
                params,
                r,
                client_id,
                span=s,
                parent_request_id=group,
                lora_name=parsed.lora_name,
                cache_salt=parsed.cache_salt,
                admitted=admitted,
            )
            for r, (ids, params, group), s in zip(rids, parallel_sampling.expand(prepared, rids, parsed), spans)
        ]
        try:
            firsts = await asyncio.gather(*(anext(s) for s in streams), return_exceptions=True)
        except BaseException:  # cancelled: the client hung up before the first token
            await _close(streams)
            raise
        for f in firsts:
            if isinstance(f, BaseException):
                await _close(streams)
                raise f
        return parsed, streams, cast("list[GenerateDelta]", firsts)  # no exception among them (above)

    def _check_tool_choice(self, parsed: ParsedRequest) -> None:
        choice = parsed.tool_choice
        if choice is not None and choice.mode == "auto" and self.tool_call_parser is None:
            raise ServingError(
                "invalid",
                'tool_choice "auto" (the default with tools) needs the server started with --tool-call-parser '
                f"({', '.join(sorted(TOOL_PARSERS))}); send tool_choice required, a named function or none",
                "tool_choice",
            )

    # ---- endpoints ----------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        fe = self.fe  # --max-prompts and --max-logit-bias are checked before the entries are read
        return await self._serve(
            request, lambda body: parse_completion(body, fe.max_prompts, fe.limits.max_logit_bias), chat=False
        )

    async def chat(self, request: Request) -> Response:
        return await self._serve(request, lambda body: parse_chat(body, self.fe.limits.max_logit_bias), chat=True)

    async def _serve(self, request: Request, parse, chat: bool) -> Response:
        sent_id = request.headers.get("x-request-id", "")
        headers = {"X-Request-Id": sent_id} if sent_id else None  # the client's own id, echoed
        rid = self.fe.new_request_id("chatcmpl" if chat else "cmpl")
        try:
            self._authenticate(request)
            client_id = self.fe.client_request_id(sent_id, "X-Request-Id")
            body = await self._read_json(request)
        except ServingError as e:
            return error_response(e, headers)
        # From here the client may hang up at any time, before or after its first token.
        answer = await until_disconnect(
            request.receive,
            self._answer(request, body, parse, rid, client_id, chat, headers),
            REQUEST_TASK_PREFIX + rid,  # a callback that holds the event loop is logged with it (loop_monitor.py)
        )
        return answer if answer is not None else Response(status_code=499)  # nobody reads it

    async def _answer(
        self, request: Request, body, parse, rid: str, client_id: str | None, chat: bool, headers: dict | None
    ) -> Response:
        try:
            parsed, streams, firsts = await self._start(request, body, parse, rid, client_id, chat)
        except ServingError as e:
            return error_response(e, headers)
        want_lp = parsed.sampling.get("logprobs") is not None
        fmt = ChunkFormat(self.fe, rid, chat, want_lp, parallel_sampling.width(parsed), parsed.lora_name)
        replies = None if parsed.tool_choice is None else ToolReplies(parsed.tool_choice, self.tool_call_parser)
        if parsed.stream:
            return StreamingResponse(
                self._events(fmt, parsed, streams, firsts, replies), media_type="text/event-stream", headers=headers
            )
        choices: list[dict[str, Any]] = [
            {"index": i, "text": "", "lps": [], "final": None} for i in range(len(streams))
        ]
        texts: list[list[str]] = [[] for _ in choices]  # joined once: `+=` per delta copies the reply
        try:
            async for i, msg in merge_streams(streams, firsts):
                c = choices[i]
                texts[i].append(msg.text)
                c["lps"].extend(msg.logprobs or [])
                if msg.finished is not None:
                    c["final"] = msg.finished
        except ServingError as e:
            return error_response(e, headers)
        finally:
            await _close(streams)
        for c, parts in zip(choices, texts):
            c["text"] = "".join(parts)
        if parsed.echo_texts is not None:
            for c in choices:
                c["text"] = parsed.echo_texts[c["index"] // fmt.width] + c["text"]
        if replies is not None:  # each choice's content, tool_calls and finish_reason
            for c in choices:
                c.update(replies[c["index"]].whole(c["text"], c["final"].finish_reason))
        finals = [c["final"] for c in choices]  # the usage counts every sample run (best_of too)
        return JSONResponse(fmt.whole(parallel_sampling.best(choices, parsed.n, fmt.width), finals), headers=headers)

    async def _events(
        self, fmt: ChunkFormat, parsed: ParsedRequest, streams, firsts, replies: ToolReplies | None = None
    ) -> AsyncIterator[str]:
        finals: list[RequestFinished | None] = [None] * len(streams)  # in choice order, for the usage
        num_prompt_tokens = cast("list[int]", parsed.num_prompt_tokens)  # counted by _dispatch
        echo_texts = parsed.echo_texts
        prompt_of = [i // fmt.width for i in range(len(streams))]  # each choice's prompt
        echo: list[str | None] | None = (
            [echo_texts[p] for p in prompt_of] if echo_texts is not None else None
        )  # None once sent
        made = [0] * len(streams) if parsed.continuous_usage else None  # completion tokens so far, per choice
        name_task(fmt.rid)  # the response's task, as _serve's: for loop_monitor.py
        try:
            for i in range(len(streams) if fmt.chat else 0):  # the role goes out for every choice, as vLLM's
                chunk = fmt.chunk(i, {"role": "assistant", "content": ""}, None, None)
                if made is not None:
                    chunk["usage"] = usage_so_far(num_prompt_tokens[prompt_of[i]], 0)
                yield "data: " + _dumps(chunk) + "\n\n"
            async for i, msg in merge_streams(streams, firsts):
                # read for tool calls, a delta makes no chunk (text held back) or several
                chunks = [fmt.delta(i, msg)] if replies is None else fmt.tool_chunks(i, msg, replies[i])
                if echo is not None and echo[i] is not None:  # the first chunk of each choice carries its prompt
                    chunks[0]["choices"][0]["text"] = echo[i] + chunks[0]["choices"][0]["text"]
                    echo[i] = None
                if made is not None:  # vLLM's per-choice usage; the finish's own counts end it
                    made[i] += len(msg.token_ids)
                    f = msg.finished
                    usage = (
                        usage_so_far(num_prompt_tokens[prompt_of[i]], made[i])
                        if f is None
                        else usage_so_far(f.num_prompt_tokens, f.num_output_tokens)
                    )
                    for chunk in chunks:
                        chunk["usage"] = usage
                for chunk in chunks:
                    yield "data: " + _dumps(chunk) + "\n\n"
                if msg.finished is not None:
                    finals[i] = msg.finished
            if parsed.include_usage:
                yield "data: " + _dumps(fmt.usage_chunk(cast("list[RequestFinished]", finals))) + "\n\n"  # all ended
        except ServingError as e:  # after the 200 went out: report in the stream, as vLLM does
            _, etype, code = _ERRORS.get(e.kind, _ERRORS["internal"])
            yield "data: " + _dumps({"error": {"message": e.message, "type": etype, "code": e.code or code}}) + "\n\n"
        finally:
            await _close(streams)
        yield "data: [DONE]\n\n"

    async def _one_shot(self, request: Request, parse):
        """Key, body and model of a call answered at once; parse -> (value, model)."""
        self._authenticate(request)
        value, model = _parsed(parse, await self._read_json(request))
        await self.fe.lora.resolve_model(model)
        return value

    async def tokenize(self, request: Request) -> Response:
        """vLLM's POST /tokenize: the ids the completion paths would send."""
        try:
            prompt = await self._one_shot(request, parse_tokenize)
            ids = await self.fe.tokenize(prompt)
            limit = self.fe.info.max_model_len
            if len(ids) > limit:
                field = "prompt" if prompt.messages is None else "messages"
                raise ServingError("invalid", f"{field} has {len(ids)} tokens; max_model_len is {limit}", field)
        except ServingError as e:
            return error_response(e)
        return JSONResponse({"count": len(ids), "max_model_len": limit, "tokens": ids, "token_strs": None})

    async def detokenize(self, request: Request) -> Response:
        """vLLM's POST /detokenize: token ids -> {"prompt": text}."""
        try:
            text = await self.fe.detokenize(await self._one_shot(request, parse_detokenize))
        except ServingError as e:
            return error_response(e)
        return JSONResponse({"prompt": text})

    async def openapi(self, request: Request) -> Response:
        """The OpenAPI 3.1 document of this API (openapi.py), built from the parsers' table."""
        return JSONResponse(openapi_document())

    async def models(self, request: Request) -> Response:
        try:
            self._authenticate(request)
        except ServingError as e:
            return error_response(e)
        info = self.fe.info
        if info.enable_lora:
            try:
                await self.fe.lora.refresh()
            except Exception as e:  # the list as last known
                logger.warning("could not read the workers' LoRA adapters: %r", e)
        base = {"object": "model", "created": 0, "owned_by": "shoal", "max_model_len": info.max_model_len}
        # vLLM's form: the base model, then each LoRA adapter with `parent` the base (root: its name, not its path)
        data = [{"id": info.model, **base, "root": info.model, "parent": None}]
        data += [{"id": name, **base, "root": name, "parent": info.model} for name in sorted(self.fe.lora.ids)]
        return JSONResponse({"object": "list", "data": data})

    async def load_lora_adapter(self, request: Request) -> Response:
        """vLLM's POST /v1/load_lora_adapter {"lora_name", "lora_path"}: behind
        the API key, and only with --allow-runtime-lora-updating (else 403)."""
        try:
            self._authenticate(request)
            body = await self._read_json(request)
            if not isinstance(body, dict):
                raise ServingError("invalid", "the request body must be a JSON object")
            _parsed(lambda b: request_schema.check("load_lora_adapter", b), body)
            await self.fe.lora.load_adapter(body.get("lora_name"), body.get("lora_path"))
        except ServingError as e:
            return error_response(e)
        return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' added successfully.")

    async def unload_lora_adapter(self, request: Request) -> Response:
        """vLLM's POST /v1/unload_lora_adapter {"lora_name"}: 409 while it is in use."""
        try:
            self._authenticate(request)
            body = await self._read_json(request)
            if not isinstance(body, dict):
                raise ServingError("invalid", "the request body must be a JSON object")
            _parsed(lambda b: request_schema.check("unload_lora_adapter", b), body)
            await self.fe.lora.unload_adapter(body.get("lora_name"))
        except ServingError as e:
            return error_response(e)
        return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' removed successfully.")

    async def health(self, request: Request) -> Response:
        """200 while this router can route to a worker (what a load balancer
        needs: one worker restarting must not take every router out);
        `?all=1`: only while every configured worker answers. The loads are
        a snapshot at most 0.5 s old, shared by every caller (load_snapshot.py)."""
        if self.fe.draining:
            return JSONResponse({"status": "draining"}, 503)
        try:
            up = len(await self.fe.load_snapshot.get())
        except Exception:
            up = 0
        need = self.fe.info.num_workers if request.query_params.get("all") in ("1", "true") else 1
        status = "ok" if up >= need else "not ready"
        return JSONResponse(
            {"status": status, "workers": up, "num_workers": self.fe.info.num_workers}, 200 if up >= need else 503
        )


@functools.cache
def openapi_document() -> dict:
    """Built once, with every error status the app answers."""
    statuses = {status: f"{etype}: {kind}" for kind, (status, etype, _) in _ERRORS.items()}
    return openapi.document(dict(sorted(statuses.items())), importlib.metadata.version("shoal"))


def _parsed(parse, body):
    """parse(body), its InvalidRequestError a 400 naming the field."""
    try:
        return parse(body)
    except InvalidRequestError as e:
        raise ServingError("invalid", str(e), e.field) from None


async def _close(streams: list) -> None:
    for s in streams:
        await s.aclose()
