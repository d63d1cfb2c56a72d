"""gRPC plumbing both services share: channel and server options, the standard
health and reflection services, and graceful shutdown on SIGTERM.

Conventions: message limits and keepalive are set on both ends,
every call carries a deadline, and nothing is gzipped (payloads are already
quantised; compressing them again costs CPU and saves nothing).

Transport security (services/contract/tls.py): with an Identity, servers listen with mutual TLS and
channels present the process's certificate; None means plaintext, which only a config saying
`tls: {mode: plaintext}` gives. A server may also serve the health service alone on a
plaintext port, for probes that cannot present a certificate.
"""
from __future__ import annotations

import logging
import signal
import threading
from concurrent import futures
from typing import Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from diloco.services.contract.config import RpcConfig
from diloco.services.contract.tls import Identity

log = logging.getLogger(__name__)


def _common_options(cfg: RpcConfig) -> list[tuple[str, int]]:
    keepalive_ms = int(cfg.keepalive_seconds * 1000)
    return [
        ("grpc.max_send_message_length", cfg.max_message_bytes),
        ("grpc.max_receive_message_length", cfg.max_message_bytes),
        ("grpc.keepalive_time_ms", keepalive_ms),
        ("grpc.keepalive_timeout_ms", max(1000, keepalive_ms // 3)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def channel_options(cfg: RpcConfig) -> list[tuple[str, int]]:
    return _common_options(cfg) + [
        # Reconnect quickly after a shard restart instead of backing off for minutes.
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2000),
        ("grpc.enable_retries", 0),  # the learner's sync client owns retry policy
    ]


def server_options(cfg: RpcConfig) -> list[tuple[str, int]]:
    keepalive_ms = int(cfg.keepalive_seconds * 1000)
    return _common_options(cfg) + [
        # Accept client pings as often as clients are configured to send them; a client that
        # pings more often is sent GOAWAY after two strikes.
        ("grpc.http2.min_recv_ping_interval_without_data_ms", keepalive_ms // 2),
        ("grpc.http2.min_ping_interval_without_data_ms", keepalive_ms // 2),
        ("grpc.http2.max_ping_strikes", 2),
        # Connections that hold resources without using them are closed (RpcConfig).
        ("grpc.server_handshake_timeout_ms", int(cfg.handshake_seconds * 1000)),
        ("grpc.max_connection_idle_ms", int(cfg.idle_connection_seconds * 1000)),
        ("grpc.max_connection_age_ms", int(cfg.max_connection_age_seconds * 1000)),
        ("grpc.max_concurrent_streams", cfg.max_streams_per_connection),
    ]


def open_channel(address: str, cfg: RpcConfig, identity: Identity | None) -> grpc.Channel:
    """A channel to `address`: mutual TLS with `identity`, plaintext with None."""
    if identity is None:
        return grpc.insecure_channel(address, options=channel_options(cfg),
                                     compression=grpc.Compression.NoCompression)
    return grpc.secure_channel(address, identity.channel_credentials(), options=channel_options(cfg),
                               compression=grpc.Compression.NoCompression)


def stream_deadline(cfg: RpcConfig, payload_bytes: int) -> float:
    """Seconds a stream carrying `payload_bytes` may take: large transfers over a slow WAN link
    need more than a unary deadline, so the unary deadline again for every MiB. Clients set it
    as their deadline, shards cut off pushes that exceed it."""
    return cfg.deadline_seconds * (1 + payload_bytes / (1 << 20))


class UnparsableRequest(ValueError):
    """A request message that does not parse (raised where the handler reads it)."""


class RefuseUnparsableRequests(grpc.ServerInterceptor):
    """gRPC answers a request message that does not parse with INTERNAL ("Exception
    deserializing request!"), as if the server had failed. It is the client's fault: this
    parses requests where the handler reads them and answers INVALID_ARGUMENT, naming the
    method. A message a handler never reads (it refused the call before) is never judged."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse, method = handler.request_deserializer, handler_call_details.method

        def parsed(data):
            try:
                return parse(data)
            except Exception:  # protobuf's DecodeError, or whatever a custom parser raises
                raise UnparsableRequest(f"{method}: a request message of {len(data)} bytes "
                                        "does not parse") from None

        def refused(context, error):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))

        kind = ("stream" if handler.request_streaming else "unary") + "_" + \
            ("stream" if handler.response_streaming else "unary")
        behavior = getattr(handler, kind)

        def call(request, context):
            if handler.request_streaming:
                return behavior(map(parsed, request), context)
            return behavior(parsed(request), context)

        if handler.response_streaming:
            def wrapped(request, context):
                try:
                    yield from call(request, context)
                except UnparsableRequest as error:
                    refused(context, error)
        else:
            def wrapped(request, context):
                try:
                    return call(request, context)
                except UnparsableRequest as error:
                    refused(context, error)
        return handler._replace(request_deserializer=None, **{kind: wrapped})


def _bound_port(add_port: Callable[[], int], listen: str) -> int:
    """The port add_port bound, or an OSError naming the address (grpcio raises RuntimeError
    where older versions returned 0)."""
    try:
        port = add_port()
    except RuntimeError:
        port = 0
    if port == 0:
        raise OSError(f"cannot listen on {listen}: the port is in use, or the address is not this machine's")
    return port


class Server:
    """A grpc.Server with health and reflection, stopped gracefully on SIGTERM.

    Graceful stop: health flips to NOT_SERVING (load balancers and probes stop
    sending new work), in-flight calls get `drain_seconds` to finish, then the
    server stops.

    With an identity the server requires client certificates of the identity's CA. A
    plaintext health port (start's `health_listen`) is a second grpc.Server holding only
    the same health service: gRPC serves every service on every port of a server, so the
    Syncer service must not share a server with a plaintext port.
    """

    def __init__(self, cfg: RpcConfig, service_names: Iterable[str], max_workers: int = 32,
                 identity: Identity | None = None):
        self.identity = identity
        self._cfg = cfg
        self.grpc_server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rpc"),
            options=server_options(cfg),
            compression=grpc.Compression.NoCompression,
            interceptors=[RefuseUnparsableRequests()],
        )
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc_server)
        self._service_names = list(service_names)
        reflection.enable_server_reflection(
            self._service_names + [health.SERVICE_NAME, reflection.SERVICE_NAME], self.grpc_server)
        self._stopped = threading.Event()
        self.port = 0
        self.health_server: grpc.Server | None = None
        self.health_port = 0

    def start(self, listen: str, health_listen: str | None = None) -> int:
        """Binds `listen` (host:port, port 0 picks a free one) and, if given, the plaintext
        health-only `health_listen`, and starts serving."""
        if self.identity is None:
            self.port = _bound_port(lambda: self.grpc_server.add_insecure_port(listen), listen)
        else:
            credentials = self.identity.server_credentials()
            self.port = _bound_port(lambda: self.grpc_server.add_secure_port(listen, credentials), listen)
        if health_listen is not None:
            self.health_server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="health"),
                                             options=server_options(self._cfg))
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            self.health_port = _bound_port(lambda: self.health_server.add_insecure_port(health_listen), health_listen)
            self.health_server.start()
        self.grpc_server.start()
        for name in self._service_names + [""]:
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return self.port

    def stop(self, drain_seconds: float) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.health.enter_graceful_shutdown()  # every service -> NOT_SERVING
        self.grpc_server.stop(grace=drain_seconds).wait()
        if self.health_server is not None:
            self.health_server.stop(grace=None).wait()

    def serve_until_signal(self, drain_seconds: float) -> None:
        """Blocks until SIGTERM or SIGINT, then stops gracefully and returns."""
        received = threading.Event()

        def handle(signum, _frame):
            log.info("%s: draining for up to %.1fs", signal.Signals(signum).name, drain_seconds)
            received.set()

        signal.signal(signal.SIGTERM, handle)
        signal.signal(signal.SIGINT, handle)
        while not received.wait(timeout=1.0):  # a timed wait keeps signals deliverable
            pass
        self.stop(drain_seconds)
