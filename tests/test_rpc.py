"""The shared server plumbing: health and reflection answer over real gRPC, and a
graceful stop flips health to NOT_SERVING before the port closes."""
import socket
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from diloco.services.contract.config import RpcConfig
from diloco.services.contract.rpc import Server, open_channel
from diloco.services.authority import issue_cluster_certs
from diloco.services.contract.tls import OPERATOR, certs_dir, learner_name, load_identity, shard_name
from tests.cluster_config import tiny_cluster

SYNCER = "diloco.v1.Syncer"


@pytest.fixture
def server():
    srv = Server(RpcConfig(), [SYNCER])
    port = srv.start("127.0.0.1:0")
    yield srv, f"127.0.0.1:{port}"
    srv.stop(drain_seconds=0)


def test_health_and_reflection(server):
    _, address = server
    with open_channel(address, RpcConfig(), None) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(health_pb2.HealthCheckRequest(service=SYNCER), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:
            health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND

        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                            timeout=5)
        names = {s.name for r in replies for s in r.list_services_response.service}
        assert {SYNCER, "grpc.health.v1.Health"} <= names


def test_graceful_stop_reports_not_serving_while_draining(server):
    srv, address = server
    srv.health.enter_graceful_shutdown()
    with open_channel(address, RpcConfig(), None) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SYNCER), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
    srv.stop(drain_seconds=0)
    with open_channel(address, RpcConfig(), None) as channel:
        with pytest.raises(grpc.RpcError) as info:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_binding_an_unusable_address_raises():
    srv = Server(RpcConfig(), [SYNCER])
    with pytest.raises(Exception):
        srv.start("256.0.0.1:1")


def test_mutual_tls_port_and_plaintext_health_port(tmp_path):
    """With an identity the server's port takes only clients holding a certificate of its CA;
    the health port answers probes in plaintext and serves nothing but health."""
    cfg = tiny_cluster(tmp_path, shards=1, learners=1)
    issue_cluster_certs(cfg, certs_dir(cfg))
    foreign = tmp_path / "another-ca"
    issue_cluster_certs(cfg, foreign)
    srv = Server(RpcConfig(), [SYNCER], identity=load_identity(cfg, shard_name(0)))
    port = srv.start("127.0.0.1:0", health_listen="127.0.0.1:0")
    address, health_address = f"127.0.0.1:{port}", f"127.0.0.1:{srv.health_port}"
    check = health_pb2.HealthCheckRequest(service=SYNCER)
    try:
        for name in (learner_name(cfg.learners[0].id), OPERATOR):
            with open_channel(address, RpcConfig(), load_identity(cfg, name)) as channel:
                assert health_pb2_grpc.HealthStub(channel).Check(check, timeout=5).status == \
                    health_pb2.HealthCheckResponse.SERVING
        for identity in (None, load_identity(cfg, OPERATOR, foreign / OPERATOR)):  # no or a foreign cert
            with open_channel(address, RpcConfig(), identity) as channel:
                with pytest.raises(grpc.RpcError) as info:
                    health_pb2_grpc.HealthStub(channel).Check(check, timeout=2)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        with open_channel(health_address, RpcConfig(), None) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            assert health.Check(check, timeout=5).status == health_pb2.HealthCheckResponse.SERVING
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                               timeout=5))
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
            srv.health.enter_graceful_shutdown()  # draining shows on the health port too
            assert health.Check(check, timeout=5).status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        srv.stop(drain_seconds=0)


def closed_by_the_server(sock: socket.socket) -> bool:
    """Reads what the server sends (its HTTP/2 settings) until it closes the connection;
    False if it is still open when the socket's timeout runs out."""
    try:
        while sock.recv(1024):
            pass
    except ConnectionResetError:
        pass
    except socket.timeout:
        return False
    return True


def test_connections_that_sit_idle_are_closed_by_the_server():
    cfg = RpcConfig(handshake_seconds=1.0, idle_connection_seconds=1.0)
    srv = Server(cfg, [SYNCER])
    port = srv.start("127.0.0.1:0")
    try:
        sockets = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(20)]
        assert all(closed_by_the_server(sock) for sock in sockets)  # a TCP connection that never speaks
        for sock in sockets:
            sock.close()
        idle = threading.Event()
        with open_channel(f"127.0.0.1:{port}", RpcConfig(), None) as channel:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            channel.subscribe(lambda state: state == grpc.ChannelConnectivity.IDLE and idle.set())
            assert idle.wait(10)  # a gRPC connection after its last call: the server sent GOAWAY
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING  # the client reconnects
    finally:
        srv.stop(drain_seconds=0)
