"""The generated gRPC stubs of proto/diloco/v1 (regenerate with scripts/gen_proto.py).

    from diloco.services.contract.wire import pb, pb_grpc
"""
from diloco.services.contract.wire.diloco.v1 import syncer_pb2 as pb
from diloco.services.contract.wire.diloco.v1 import syncer_pb2_grpc as pb_grpc

__all__ = ["REFUSAL_REASON_KEY", "pb", "pb_grpc"]

# A shard's refusal carries its short reason ("norm_outlier", "duplicate", ...) in this key of the
# call's trailing metadata, beside the status and message (docs/protocol.md).
REFUSAL_REASON_KEY = "diloco-reason"
