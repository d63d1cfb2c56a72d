"""The one rule a learner follows for a shard's error (learner/sync/shard_errors.py)."""
from __future__ import annotations

import threading

import grpc
import pytest

from diloco.learner.sync.shard_errors import Remedy, remedy, with_retries


class ShardError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode):
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "details"


@pytest.mark.parametrize("code, expected", [
    (grpc.StatusCode.UNAVAILABLE, Remedy.RETRY_LATER),
    (grpc.StatusCode.DEADLINE_EXCEEDED, Remedy.RETRY_LATER),
    (grpc.StatusCode.CANCELLED, Remedy.RETRY_LATER),
    (grpc.StatusCode.FAILED_PRECONDITION, Remedy.REJOIN),
    (grpc.StatusCode.NOT_FOUND, Remedy.REJOIN),
    (grpc.StatusCode.ALREADY_EXISTS, Remedy.ALREADY_DELIVERED),
    (grpc.StatusCode.INVALID_ARGUMENT, Remedy.STOP),
    (grpc.StatusCode.PERMISSION_DENIED, Remedy.STOP),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, Remedy.RETRY_LATER),
])
def test_each_status_code_has_one_remedy(code, expected):
    assert remedy(ShardError(code)) is expected


def test_a_shard_that_is_down_is_retried_until_it_answers_naming_its_address(caplog):
    answers = [ShardError(grpc.StatusCode.UNAVAILABLE)] * 2 + ["joined"]

    def call():
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    stop = threading.Event()
    stop.set()  # no backoff sleeps in a test
    assert with_retries(call, "shard 0 (10.0.0.7:50051)", give_up=lambda: False, stop=stop) == "joined"
    assert answers == []
    assert "shard 0 (10.0.0.7:50051) unreachable (UNAVAILABLE); retrying in 0.2s" in caplog.text


def test_retrying_ends_when_told_to_give_up_and_never_retries_a_refusal():
    stop = threading.Event()
    stop.set()
    calls = []

    def call(code):
        calls.append(code)
        raise ShardError(code)

    with pytest.raises(grpc.RpcError):
        with_retries(lambda: call(grpc.StatusCode.UNAVAILABLE), "shard 0", give_up=lambda: len(calls) >= 3, stop=stop)
    assert len(calls) == 3
    calls.clear()
    with pytest.raises(grpc.RpcError):
        with_retries(lambda: call(grpc.StatusCode.FAILED_PRECONDITION), "shard 0", give_up=lambda: False, stop=stop)
    assert len(calls) == 1
