"""The gRPC front: shoal.v1.Shoal, grpc.health.v1.Health and server reflection
on one grpc.aio server."""

from __future__ import annotations

import logging
from contextlib import aclosing

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from shoal.proto.messages import GenerateDelta
from shoal.proto.v1 import shoal_pb2 as pb
from shoal.proto.v1 import shoal_pb2_grpc
from shoal.router.fronts import parallel_sampling
from shoal.router.fronts.frontend import Frontend, ServingError
from shoal.router.fronts.grpc_connections import connection_options
from shoal.router.fronts.grpc_request import parse_generate, parse_prompt
from shoal.router.fronts.stream_merge import merge_streams
from shoal.router.fronts.tls import TLSFiles
from shoal.router.fronts.tool_parsers import get_tool_parser
from shoal.router.fronts.tool_replies import ToolReply
from shoal.router.observability import tracing
from shoal.router.observability.loop_monitor import name_task

logger = logging.getLogger(__name__)
SERVICE = pb.DESCRIPTOR.services_by_name["Shoal"].full_name
_CODES = {
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "unauthenticated": grpc.StatusCode.UNAUTHENTICATED,
    "not_found": grpc.StatusCode.NOT_FOUND,
    "forbidden": grpc.StatusCode.PERMISSION_DENIED,
    "conflict": grpc.StatusCode.FAILED_PRECONDITION,
    "too_large": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "full": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "internal": grpc.StatusCode.INTERNAL,
}


def _add_tool_calls(r: pb.GenerateResponse, reply: ToolReply, text: str) -> None:
    """A choice's last message: the calls its whole reply holds, and the finish
    reason the HTTP front gives it ("tool_calls" when auto called or required stopped)."""
    got = reply.whole(text, r.finished.finish_reason)
    for c in got["tool_calls"] or ():
        f = c["function"]
        r.tool_calls.append(
            pb.ToolCall(id=c["id"], type=c["type"], function=pb.FunctionCall(name=f["name"], arguments=f["arguments"]))
        )
    r.finished.finish_reason = got["finish_reason"]


def _response(request_id: str, client_request_id: str, msg: GenerateDelta, index: int = 0) -> pb.GenerateResponse:
    r = pb.GenerateResponse(
        request_id=request_id,
        client_request_id=client_request_id,
        token_ids=msg.token_ids,
        text=msg.text,
        index=index,
    )
    for lp in msg.logprobs or ():
        r.logprobs.append(
            pb.TokenLogprob(
                token_id=lp.token_id,
                logprob=lp.logprob,
                top_logprobs=[pb.TopLogprob(token_id=k, logprob=v) for k, v in lp.top_logprobs.items()],
            )
        )
    if (f := msg.finished) is not None:
        r.finished.CopyFrom(
            pb.Finished(
                finish_reason=f.finish_reason,
                stop_reason="" if f.stop_reason is None else str(f.stop_reason),
                worker=f.worker,
                usage=pb.Usage(
                    prompt_tokens=f.num_prompt_tokens,
                    completion_tokens=f.num_output_tokens,
                    cached_tokens=f.num_cached_tokens,
                ),
                timings=pb.Timings(queue_s=f.queue_s, time_to_first_token_s=f.time_to_first_token_s, total_s=f.total_s),
            )
        )
    return r


class ShoalServicer(shoal_pb2_grpc.ShoalServicer):
    def __init__(self, frontend: Frontend, allow_client_priority: bool = False, tool_call_parser: str | None = None):
        self.fe = frontend
        # The scheduler's queue order and preemption are the operator's: a client's priority only when allowed.
        self.allow_client_priority = allow_client_priority
        if tool_call_parser is not None:
            get_tool_parser(tool_call_parser)  # an unknown name fails the start, not a request
        self.tool_call_parser = tool_call_parser  # reads tool_choice "auto" replies (--tool-call-parser)

    async def _abort(self, context, e: ServingError):
        await context.abort(_CODES.get(e.kind, grpc.StatusCode.INTERNAL), e.message)

    async def Generate(self, request: pb.GenerateRequest, context):
        """n choices are n engine requests `rid-<k>` (parallel_sampling.py, as
        the HTTP front's), merged into one stream; each message has its index."""
        spans, admitted = [], None
        try:
            g = parse_generate(request, self.fe.info.max_n, self.fe.limits.max_logit_bias)
            if request.priority and not self.allow_client_priority:
                raise ServingError(
                    "invalid",
                    "priority is set by the operator here; send 0 (the server runs without --allow-client-priority)",
                    field="priority",
                )
            replies = self._tool_replies(g.tool_choice, g.n)
            client_id = self.fe.client_request_id(request.request_id, "request_id")
            lora = await self.fe.lora.resolve_model(request.lora) if request.lora else None
            rid = self.fe.new_request_id("gen")
            name_task(rid)  # a callback that holds the event loop is logged with it (loop_monitor.py)
            # Its n sequences count against --max-concurrent-requests until their streams end (admission.py).
            admitted = self.fe.admission.admit(g.n, "n")
            rids = parallel_sampling.request_ids(rid, g.n)
            # One trace span per engine request, each a child of the client's context (traceparent metadata).
            parent = tracing.context_from_metadata(context.invocation_metadata())
            op = "chat" if g.prompt.messages is not None else "text_completion"
            spans = [self.fe.start_span(parent, op, r, client_id, True, lora) for r in rids]
            ids, params = await self.fe.prepare(g.prompt, g.sampling, spans[0])
            # Within --max-tokens-per-request: an unset max_tokens (16) shrinks, a chosen one must fit.
            [(ids, params)] = self.fe.admission.fit_tokens(
                [(ids, params)], g.n, request.sampling.HasField("max_tokens")
            )
            group = rids[0] if g.n > 1 else None  # the request router keeps the samples on one worker
            streams = [
                self.fe.generate(
                    ids,
                    parallel_sampling.sample_params(params, k, ranked=False),
                    r,
                    client_id,
                    request.priority,
                    span=s,
                    parent_request_id=group,
                    lora_name=lora,
                    cache_salt=g.cache_salt,
                    admitted=admitted,
                )
                for k, (r, s) in enumerate(zip(rids, spans))
            ]
            texts: list[list[str]] = [[] for _ in range(g.n)]  # joined once: `+=` per delta copies the reply
            async with aclosing(merge_streams(streams)) as merged:
                async for k, msg in merged:
                    r = _response(rid, request.request_id, msg, k)
                    if replies is not None:
                        texts[k].append(msg.text)
                        if msg.finished is not None:
                            _add_tool_calls(r, replies[k], "".join(texts[k]))
                    yield r
        except ServingError as e:
            for s in spans:  # a no-op for those whose own path ended them
                tracing.fail_request_span(s, e)
            await self._abort(context, e)
        finally:
            for s in spans:  # the client went away before a stream began (a no-op once ended)
                tracing.end_request_span(s, cancelled=True)
            if admitted is not None:  # those of streams that never started (each started one gives its own back)
                admitted.release_unclaimed()

    def _tool_replies(self, choice, n: int) -> list[ToolReply] | None:
        """A reader of each choice's reply for tool calls, when the request has a tool choice."""
        if choice is None:
            return None
        if choice.mode == "auto" and self.tool_call_parser is None:
            raise ServingError(
                "invalid",
                'tool_choice "auto" needs a tool-call parser and this server has none (--tool-call-parser): '
                'send tool_choice "required" or "none", or tool_choice_function',
                field="tool_choice",
            )
        return [ToolReply(choice, self.tool_call_parser) for _ in range(n)]

    async def GetModelInfo(self, request, context):
        i = self.fe.info
        if i.enable_lora:
            try:
                await self.fe.lora.refresh()
            except Exception as e:  # the list as last known
                logger.warning("could not read the workers' LoRA adapters: %r", e)
        return pb.ModelInfo(
            lora_adapters=[pb.LoRAAdapter(name=name, parent=i.model) for name in sorted(self.fe.lora.ids)],
            max_loras=i.max_loras,
            model=i.model,
            max_model_len=i.max_model_len,
            vocab_size=i.vocab_size,
            block_size=i.block_size,
            tensor_parallel_size=i.tensor_parallel_size,
            num_workers=i.num_workers,
        )

    async def GetLoad(self, request, context):
        return pb.LoadReport(
            workers=[
                pb.WorkerLoad(
                    worker=s.worker,
                    num_free_blocks=s.num_free_blocks,
                    num_total_blocks=s.num_total_blocks,
                    num_running=s.num_running,
                    num_waiting=s.num_waiting,
                )
                for s in await self.fe.load()  # behind the key: the workers as they are now (/health: a snapshot)
            ]
        )

    async def Tokenize(self, request: pb.TokenizeRequest, context):
        try:
            prompt = parse_prompt(request)
            if request.HasField("add_special_tokens"):
                prompt.add_special_tokens = request.add_special_tokens
            ids = await self.fe.tokenize(prompt)
        except ServingError as e:
            await self._abort(context, e)
        return pb.TokenizeResponse(token_ids=ids, count=len(ids), max_model_len=self.fe.info.max_model_len)


class _AuthInterceptor(grpc.aio.ServerInterceptor):
    """With an API key set, every call but the health check needs
    `authorization: Bearer KEY` in its metadata."""

    def __init__(self, frontend: Frontend):
        self.fe = frontend

        async def deny(request, context):
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED, "a valid API key is required (authorization: Bearer KEY)"
            )

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)

    async def intercept_service(self, continuation, details):
        if self.fe.api_key is None or details.method.startswith("/grpc.health.v1.Health/"):
            return await continuation(details)
        auth = dict(details.invocation_metadata or ()).get("authorization", "")
        scheme, _, token = auth.partition(" ")
        try:
            self.fe.authenticate(token.strip() if scheme.lower() == "bearer" else None)
        except ServingError:
            handler = await continuation(details)
            return self._deny_stream if handler is not None and handler.response_streaming else self._deny_unary
        return await continuation(details)


class GrpcServer:
    """start() binds host:port; set_serving() flips the health status."""

    def __init__(
        self,
        frontend: Frontend,
        host: str,
        port: int,
        max_request_bytes: int,
        max_concurrent_rpcs: int | None = None,
        allow_client_priority: bool = False,
        tool_call_parser: str | None = None,
        max_connections: int | None = None,
        handshake_timeout_s: float | None = None,
        tls: TLSFiles | None = None,
    ):
        """max_connections, handshake_timeout_s: grpc_connections.py; tls: serve TLS (tls.py)."""
        # Past max_concurrent_rpcs calls in flight, grpc.aio answers RESOURCE_EXHAUSTED itself.
        self.server = grpc.aio.server(
            interceptors=[_AuthInterceptor(frontend)],
            maximum_concurrent_rpcs=max_concurrent_rpcs,
            options=[
                # SO_REUSEPORT: the routers on one host share the port (see ingress.reuse_port_socket).
                ("grpc.max_receive_message_length", max_request_bytes),
                ("grpc.so_reuseport", 1),
                *connection_options(max_connections, handshake_timeout_s),
            ],
        )
        shoal_pb2_grpc.add_ShoalServicer_to_server(
            ShoalServicer(frontend, allow_client_priority, tool_call_parser), self.server
        )
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection([SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        host = f"[{host}]" if ":" in host else host
        address = f"{host}:{port}"
        if tls is None:
            self.port = self.server.add_insecure_port(address)
        else:
            self.port = self.server.add_secure_port(address, tls.grpc_credentials())
        if self.port == 0:
            raise OSError(f"cannot listen for gRPC on {host}:{port}")

    async def start(self) -> None:
        await self.server.start()
        await self.set_serving(True)

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE):
            await self.health.set(name, status)

    async def stop(self, grace_s: float | None = None) -> None:
        await self.server.stop(grace_s)
