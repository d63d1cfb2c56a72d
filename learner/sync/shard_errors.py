"""What a learner does about a shard's error: one rule for every call it makes.

    RETRY_LATER        the shard is down, restarting or cannot take it now (UNAVAILABLE,
                       DEADLINE_EXCEEDED, CANCELLED; RESOURCE_EXHAUSTED: its disk is full, or
                       too many calls): try again with backoff; a sync skips, training goes on
    REJOIN             the shard forgot this learner or the version it holds (a restart:
                       FAILED_PRECONDITION, NOT_FOUND): rejoin, which restores or re-anchors
    ALREADY_DELIVERED  an earlier attempt got through (its reply was lost; ALREADY_EXISTS)
    STOP               refused for a reason retrying cannot change: counted, and at a join
                       the learner stops with the shard's reason

At a join every answer but RETRY_LATER is a refusal: a shard that does not know the model
(FAILED_PRECONDITION there) will not know it the next time either.
"""
from __future__ import annotations

import enum
import logging
import threading
from typing import Callable, Iterator, TypeVar

import grpc

from diloco.services.contract.wire import REFUSAL_REASON_KEY

log = logging.getLogger(__name__)

# A shard that does not answer is retried after this long, doubling up to the cap.
RETRY_INITIAL_SECONDS = 0.2
RETRY_MAX_SECONDS = 5.0

T = TypeVar("T")


class Remedy(enum.Enum):
    RETRY_LATER = "retry later"
    REJOIN = "rejoin"
    ALREADY_DELIVERED = "already delivered"
    STOP = "stop"


_REMEDIES = {
    grpc.StatusCode.UNAVAILABLE: Remedy.RETRY_LATER,
    grpc.StatusCode.DEADLINE_EXCEEDED: Remedy.RETRY_LATER,
    grpc.StatusCode.CANCELLED: Remedy.RETRY_LATER,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Remedy.RETRY_LATER,
    grpc.StatusCode.FAILED_PRECONDITION: Remedy.REJOIN,
    grpc.StatusCode.NOT_FOUND: Remedy.REJOIN,
    grpc.StatusCode.ALREADY_EXISTS: Remedy.ALREADY_DELIVERED,
}


def remedy(error: grpc.RpcError) -> Remedy:
    return _REMEDIES.get(error.code(), Remedy.STOP)


def refusal_reason(error: grpc.RpcError) -> str | None:
    """The shard's short reason for a refusal ("norm_outlier", ...), which it sends in the
    trailing metadata (REFUSAL_REASON_KEY); None when there is none."""
    metadata = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    return next((value for key, value in metadata or () if key == REFUSAL_REASON_KEY), None)


def reason(error: grpc.RpcError) -> str:
    """The shard's status and message, as logs and refusals quote them."""
    return f"{error.code().name} {error.details()}"


def backoff_delays() -> Iterator[float]:
    """The waits between tries: RETRY_INITIAL_SECONDS, doubling up to RETRY_MAX_SECONDS."""
    delay = RETRY_INITIAL_SECONDS
    while True:
        yield delay
        delay = min(delay * 2, RETRY_MAX_SECONDS)


def with_retries(call: Callable[[], T], shard: str, give_up: Callable[[], bool],
                 stop: threading.Event) -> T:
    """call(), again with backoff while the shard is down, until `give_up()` says to stop
    trying (then, and for any other error, the error is raised). `stop` cuts a backoff short.
    `shard` names it in the log: its index and address, which the operator can check."""
    for delay in backoff_delays():
        try:
            return call()
        except grpc.RpcError as error:
            if remedy(error) is not Remedy.RETRY_LATER or give_up():
                raise
            log.warning("%s unreachable (%s); retrying in %.1fs", shard, error.code().name, delay)
        stop.wait(delay)
