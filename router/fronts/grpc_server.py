"""The gRPC front: shoal.v1.Shoal, grpc.health.v1.Health and server reflection
on one grpc.aio server."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from shoal.proto.v1 import shoal_pb2 as pb
from shoal.proto.v1 import shoal_pb2_grpc
from shoal.router.fronts.frontend import Frontend, ServingError
from shoal.router.fronts.prompt import Prompt
from shoal.router.observability import tracing
from shoal.workers.messages import GenerateDelta

SERVICE = pb.DESCRIPTOR.services_by_name["Shoal"].full_name
_CODES = {
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "unauthenticated": grpc.StatusCode.UNAUTHENTICATED,
    "not_found": grpc.StatusCode.NOT_FOUND,
    "too_large": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "full": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "internal": grpc.StatusCode.INTERNAL,
}
_SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "min_tokens",
    "logprobs",
    "skip_special_tokens",
)


def _prompt(msg, which: str) -> Prompt:
    if which == "text":
        return Prompt(text=msg.text)
    if which == "token_ids":
        return Prompt(token_ids=list(msg.token_ids.ids))
    if which == "chat":
        return Prompt(messages=[{"role": m.role, "content": m.content} for m in msg.chat.messages])
    raise ServingError("invalid", "a prompt is required: text, token_ids or chat", field="prompt")


def _sampling(sp: pb.SamplingParams) -> dict:
    out = {name: getattr(sp, name) for name in _SAMPLING_FIELDS if sp.HasField(name)}
    out.setdefault("max_tokens", 16)
    if sp.stop:
        out["stop"] = list(sp.stop)
    if sp.stop_token_ids:
        out["stop_token_ids"] = list(sp.stop_token_ids)
    if sp.ignore_eos:
        out["ignore_eos"] = True
    return out


def _response(request_id: str, client_request_id: str, msg: GenerateDelta) -> pb.GenerateResponse:
    r = pb.GenerateResponse(
        request_id=request_id, client_request_id=client_request_id, token_ids=msg.token_ids, text=msg.text
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
    def __init__(self, frontend: Frontend, allow_client_priority: bool = False):
        self.fe = frontend
        # The scheduler's queue order and preemption are the operator's: a client's priority only when allowed.
        self.allow_client_priority = allow_client_priority

    async def _abort(self, context, e: ServingError):
        await context.abort(_CODES.get(e.kind, grpc.StatusCode.INTERNAL), e.message)

    async def Generate(self, request: pb.GenerateRequest, context):
        span = None
        try:
            which = request.WhichOneof("prompt")
            prompt = _prompt(request, which)
            sampling = _sampling(request.sampling)
            if request.priority and not self.allow_client_priority:
                raise ServingError(
                    "invalid",
                    "priority is set by the operator here; send 0 (the server runs without --allow-client-priority)",
                    field="priority",
                )
            client_id = self.fe.client_request_id(request.request_id, "request_id")
            rid = self.fe.new_request_id("gen")
            # The trace starts from the client's context, sent as gRPC metadata (traceparent).
            span = self.fe.start_span(
                tracing.context_from_metadata(context.invocation_metadata()),
                "chat" if which == "chat" else "text_completion",
                rid,
                client_id,
                True,
            )
            ids, params = await self.fe.prepare(prompt, sampling, span)
            async for msg in self.fe.generate(ids, params, rid, client_id, request.priority, span=span):
                yield _response(rid, request.request_id, msg)
        except ServingError as e:
            tracing.fail_request_span(span, e)  # a no-op once the request's own path ended it
            await self._abort(context, e)

    async def GetModelInfo(self, request, context):
        i = self.fe.info
        return pb.ModelInfo(
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
                for s in await self.fe.load()
            ]
        )

    async def Tokenize(self, request: pb.TokenizeRequest, context):
        try:
            which = request.WhichOneof("prompt")
            if which is None:
                raise ServingError("invalid", "a prompt is required: text or chat", field="prompt")
            prompt = _prompt(request, which)
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
    ):
        # Past max_concurrent_rpcs calls in flight, grpc.aio answers RESOURCE_EXHAUSTED itself.
        self.server = grpc.aio.server(
            interceptors=[_AuthInterceptor(frontend)],
            maximum_concurrent_rpcs=max_concurrent_rpcs,
            options=[
                # SO_REUSEPORT: the routers on one host share the port (see ingress.reuse_port_socket).
                ("grpc.max_receive_message_length", max_request_bytes),
                ("grpc.so_reuseport", 1),
            ],
        )
        shoal_pb2_grpc.add_ShoalServicer_to_server(ShoalServicer(frontend, allow_client_priority), self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection([SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        host = f"[{host}]" if ":" in host else host
        self.port = self.server.add_insecure_port(f"{host}:{port}")
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
