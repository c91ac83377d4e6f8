"""What one connection may hold of a router, over a real uvicorn server and
raw sockets: a request's headers and body have deadlines (a client that
stops half way is closed, or gets 408), open connections are capped (the
extra ones get 503 and are closed while those open go on), and TLS serves
both ports. The deadlines are set short here; each assertion only waits,
with a wide margin, for the server to act, never times how fast it does."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import ssl
from contextlib import asynccontextmanager
from functools import partial

import grpc
import httpx
import pytest
from engine_hold import until
from grpc_health.v1 import health_pb2, health_pb2_grpc
from serving import free_port, make_frontend
from uvicorn.protocols.http.h11_impl import H11Protocol

from shoal.proto.v1 import shoal_pb2 as pb
from shoal.proto.v1 import shoal_pb2_grpc
from shoal.router.fronts import http_connections, ingress
from shoal.router.fronts.grpc_server import GrpcServer
from shoal.router.fronts.http_connections import ConnectionLimits, connection_cap
from shoal.router.fronts.openai_app import OpenAIApp
from shoal.router.fronts.tls import TLSFiles

WAIT_S = 30.0  # how long a test waits for the server to act: far past every deadline set here
HEALTH = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


@pytest.fixture(params=["httptools", "h11"])
def protocol(request, monkeypatch):
    """Both of uvicorn's HTTP/1.1 protocols get the bounds (uvicorn's "auto" picks httptools when installed)."""
    if request.param == "h11":
        monkeypatch.setattr(ingress, "protocol_class", partial(http_connections.protocol_class, base=H11Protocol))
    return request.param


@asynccontextmanager
async def served(fe, limits: ConnectionLimits, tls: TLSFiles | None = None, **app):
    port = free_port()
    server, task = await ingress.start_http(OpenAIApp(fe, 1 << 20, **app).app, "127.0.0.1", port, None, limits, tls)
    try:
        yield server, port
    finally:
        server.should_exit = True
        await task


async def _response(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One HTTP/1.1 response with a Content-Length: (status line and headers, body)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
    length = next(
        int(v) for k, _, v in (h.partition(b":") for h in head.split(b"\r\n")) if k.lower() == b"content-length"
    )
    return head, await asyncio.wait_for(reader.readexactly(length), WAIT_S)


async def _closed(reader: asyncio.StreamReader) -> bytes:
    """All the server sends until it closes the connection (a TimeoutError if it never does)."""
    return await asyncio.wait_for(reader.read(), WAIT_S)


def test_a_request_never_finished_is_closed_after_the_header_timeout(tiny_model, protocol):
    async def main():
        fe = make_frontend(tiny_model)
        # A keep-alive wait longer than the test: only the header deadline can close these.
        limits = ConnectionLimits(header_timeout_s=0.5, keep_alive_timeout_s=WAIT_S)
        async with served(fe, limits) as (server, port):
            silent = await asyncio.open_connection("127.0.0.1", port)
            half_line = await asyncio.open_connection("127.0.0.1", port)
            half_line[1].write(b"GET /hea")
            half_headers = await asyncio.open_connection("127.0.0.1", port)
            half_headers[1].write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            # After a full request and its answer, the next request's headers are timed too.
            kept = await asyncio.open_connection("127.0.0.1", port)
            kept[1].write(HEALTH)
            first = await _response(kept[0])
            kept[1].write(b"GET /health HTTP/1.1\r\nHost: 127")
            out = [await _closed(r) for r, _ in (silent, half_line, half_headers, kept)]
            # The server answers the next client as before.
            fresh = await asyncio.open_connection("127.0.0.1", port)
            fresh[1].write(HEALTH)
            after = await _response(fresh[0])
            for _, w in (silent, half_line, half_headers, kept, fresh):
                w.close()
            return first, out, after

    first, out, after = asyncio.run(main())
    assert first[0].startswith(b"HTTP/1.1 200")
    assert out == [b"", b"", b"", b""]  # closed, nothing sent
    assert after[0].startswith(b"HTTP/1.1 200") and json.loads(after[1])["status"] == "ok"


def test_a_body_never_finished_gets_408_and_others_are_served(tiny_model, protocol):
    async def main():
        fe = make_frontend(tiny_model)
        async with served(fe, ConnectionLimits(keep_alive_timeout_s=WAIT_S), body_timeout_s=0.5) as (_, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b'Content-Length: 100\r\n\r\n{"prompt": "The quick'
            )
            slow = await _closed(reader)  # the 408, then the connection ends
            writer.close()
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=WAIT_S) as c:
                good = await c.post("/v1/completions", json={"prompt": "The quick brown fox", "max_tokens": 2})
        return slow, good

    slow, good = asyncio.run(main())
    head, _, body = slow.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower()
    err = json.loads(body)["error"]
    assert err["code"] == "request_timeout" and "0.5 s" in err["message"]
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 2


def test_past_max_connections_new_ones_get_503_and_the_open_ones_are_served(tiny_model, protocol):
    cap, extra = 4, 3

    async def main():
        fe = make_frontend(tiny_model)
        limits = ConnectionLimits(header_timeout_s=WAIT_S, keep_alive_timeout_s=WAIT_S, max_connections=cap)
        async with served(fe, limits) as (server, port):
            conns = server.server_state.connections
            kept = await asyncio.open_connection("127.0.0.1", port)
            kept[1].write(HEALTH)
            first = await _response(kept[0])
            idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(cap - 1)]
            full_after = await until(lambda: len(conns) == cap)
            refused = []
            for _ in range(extra):
                r, w = await asyncio.open_connection("127.0.0.1", port)
                refused.append(await _closed(r))
                w.close()
            kept[1].write(HEALTH)  # an open connection is served as before
            again = await _response(kept[0])
            for _, w in idle:
                w.close()
            freed_after = await until(lambda: len(conns) == 1)
            fresh = await asyncio.open_connection("127.0.0.1", port)  # room again
            fresh[1].write(HEALTH)
            after = await _response(fresh[0])
            for _, w in (kept, fresh):
                w.close()
        return first, full_after, refused, again, freed_after, after

    first, full_after, refused, again, freed_after, after = asyncio.run(main())
    assert full_after < 10 and freed_after < 10
    for got in refused:
        head, _, body = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503") and json.loads(body)["error"]["code"] == "too_many_connections"
    assert all(r[0].startswith(b"HTTP/1.1 200") for r in (first, again, after))


def test_grpc_past_max_connections_a_new_connection_is_closed_and_the_open_one_is_served(tiny_model):
    info = pb.GetModelInfoRequest()
    own = [("grpc.use_local_subchannel_pool", 1)]  # each channel its own connection

    async def main():
        fe = make_frontend(tiny_model)
        server = GrpcServer(fe, "127.0.0.1", 0, 1 << 20, max_connections=1, handshake_timeout_s=10)
        await server.start()
        addr = f"127.0.0.1:{server.port}"
        try:
            async with grpc.aio.insecure_channel(addr, options=own) as b:
                async with grpc.aio.insecure_channel(addr, options=own) as a:
                    first = await shoal_pb2_grpc.ShoalStub(a).GetModelInfo(info, timeout=WAIT_S)
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await shoal_pb2_grpc.ShoalStub(b).GetModelInfo(info, timeout=WAIT_S)
                    again = await shoal_pb2_grpc.ShoalStub(a).GetModelInfo(info, timeout=WAIT_S)
                # a's connection gone, b gets in (its reconnect waits for the server to see it go)
                after = await shoal_pb2_grpc.ShoalStub(b).GetModelInfo(info, timeout=WAIT_S, wait_for_ready=True)
        finally:
            await server.stop(0)
        return first, refused.value, again, after, fe

    first, refused, again, after, fe = asyncio.run(main())
    assert refused.code() == grpc.StatusCode.UNAVAILABLE
    assert first.model == again.model == after.model == fe.info.model


def test_connection_cap_stays_under_the_open_files_limit():
    assert connection_cap(None, 1024) == (1024 - 256) // 2
    assert connection_cap(100, 1024) == 100
    assert connection_cap(10_000, 1024) == (1024 - 256) // 2  # never above the limit
    big = connection_cap(None, 1 << 16)
    assert 2 * big < 1 << 16 and big > 20_000


# ---- TLS -----------------------------------------------------------------------------------


def _self_signed(tmp_path) -> tuple[str, str]:
    """A certificate for localhost and 127.0.0.1, signed by its own key: (cert file, key file)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(cert_file), str(key_file)


def test_tls_on_the_http_and_grpc_ports(tiny_model, tmp_path):
    cert, key = _self_signed(tmp_path)
    tls = TLSFiles(cert, key)

    async def main():
        fe = make_frontend(tiny_model)
        grpc_srv = GrpcServer(fe, "127.0.0.1", 0, 1 << 20, tls=tls, max_connections=64, handshake_timeout_s=10)
        await grpc_srv.start()
        try:
            async with served(fe, ConnectionLimits(), tls) as (_, port):
                trusted = ssl.create_default_context(cafile=cert)
                async with httpx.AsyncClient(base_url=f"https://localhost:{port}", verify=trusted, timeout=WAIT_S) as c:
                    health = await c.get("/health")
                    done = await c.post("/v1/completions", json={"prompt": "The quick brown fox", "max_tokens": 2})
                # A client that does not trust the certificate is refused by its own check.
                async with httpx.AsyncClient(base_url=f"https://localhost:{port}", timeout=WAIT_S) as c:
                    with pytest.raises(httpx.ConnectError):
                        await c.get("/health")
                # Plain HTTP gets no HTTP answer on a TLS port.
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=WAIT_S) as c:
                    with pytest.raises(httpx.HTTPError):
                        await c.get("/health")
            creds = grpc.ssl_channel_credentials(root_certificates=open(cert, "rb").read())
            async with grpc.aio.secure_channel(f"localhost:{grpc_srv.port}", creds) as ch:
                info = await shoal_pb2_grpc.ShoalStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=WAIT_S)
                served_ = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=WAIT_S)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_srv.port}") as ch:
                with pytest.raises(grpc.aio.AioRpcError) as plain:
                    await shoal_pb2_grpc.ShoalStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
        finally:
            await grpc_srv.stop(0)
        return health, done, info, served_, plain.value, fe

    health, done, info, served_, plain, fe = asyncio.run(main())
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 2
    assert info.model == fe.info.model
    assert served_.status == health_pb2.HealthCheckResponse.SERVING
    assert plain.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize(
    "flags,word",
    [
        ({"ssl_certfile": "c.pem"}, "go together"),
        ({"ssl_keyfile": "k.pem"}, "go together"),
        ({"ssl_ca_certs": "ca.pem"}, "need TLS on"),
        ({"ssl_certfile": "c.pem", "ssl_keyfile": "k.pem", "ssl_cert_reqs": 2}, "ssl_ca_certs"),
        ({"http_body_timeout_s": 0}, "http_body_timeout_s"),
        ({"max_connections": 0}, "max_connections"),
    ],
)
def test_tls_and_connection_flags_that_make_no_sense_are_refused(flags, word):
    from shoal.cluster.options import ServeOptions

    with pytest.raises(ValueError, match=word):
        ServeOptions(**flags).validate()
    ok = ServeOptions(ssl_certfile="c.pem", ssl_keyfile="k.pem", ssl_ca_certs="ca.pem", ssl_cert_reqs=2)
    ok.validate()
    assert TLSFiles.from_options(ok.router_options()) == TLSFiles("c.pem", "k.pem", "ca.pem", 2)
    assert TLSFiles.from_options(ServeOptions().router_options()) is None
