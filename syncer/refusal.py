"""A request the shard turns down.

Decisions raise Refusal; the gRPC servicer answers it with `grpc.StatusCode[status]` and the
message, and the core counts it under `refusals.<reason>`. A refused request never changes
the shard's state.
"""
from __future__ import annotations


class Refusal(Exception):
    def __init__(self, reason: str, status: str, message: str):
        super().__init__(message)
        self.reason = reason  # short label, counted: "duplicate", "checksum", ...
        self.status = status  # gRPC status code name: "ALREADY_EXISTS", "DATA_LOSS", ...
        self.message = message  # names the problem, for the caller

    def __repr__(self) -> str:
        return f"Refusal({self.reason!r}, {self.status!r}, {self.message!r})"
