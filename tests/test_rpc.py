"""The shared server plumbing: health and reflection answer over real gRPC, and a
graceful stop flips health to NOT_SERVING before the port closes."""
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.config import RpcConfig
from services.rpc import Server, open_channel

SYNCER = "diloco.v1.Syncer"


@pytest.fixture
def server():
    srv = Server(RpcConfig(), [SYNCER])
    port = srv.start("127.0.0.1:0")
    yield srv, f"127.0.0.1:{port}"
    srv.stop(drain_seconds=0)


def test_health_and_reflection(server):
    _, address = server
    with open_channel(address, RpcConfig()) as channel:
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
    with open_channel(address, RpcConfig()) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SYNCER), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
    srv.stop(drain_seconds=0)
    with open_channel(address, RpcConfig()) as channel:
        with pytest.raises(grpc.RpcError) as info:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_binding_an_unusable_address_raises():
    srv = Server(RpcConfig(), [SYNCER])
    with pytest.raises(Exception):
        srv.start("256.0.0.1:1")
