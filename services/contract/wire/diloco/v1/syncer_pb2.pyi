from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Codec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CODEC_UNSPECIFIED: _ClassVar[Codec]
    CODEC_FP32: _ClassVar[Codec]
    CODEC_BF16: _ClassVar[Codec]
    CODEC_INT8: _ClassVar[Codec]
    CODEC_INT4: _ClassVar[Codec]
    CODEC_FP4_E3M0: _ClassVar[Codec]

class PushKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PUSH_KIND_UNSPECIFIED: _ClassVar[PushKind]
    PUSH_KIND_OUTER_GRADIENT: _ClassVar[PushKind]
    PUSH_KIND_SEED: _ClassVar[PushKind]
    PUSH_KIND_RESTORE: _ClassVar[PushKind]

class PushResult(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PUSH_RESULT_UNSPECIFIED: _ClassVar[PushResult]
    PUSH_RESULT_ACCEPTED: _ClassVar[PushResult]
    PUSH_RESULT_STALE_MERGED: _ClassVar[PushResult]
    PUSH_RESULT_REFUSED_STALE: _ClassVar[PushResult]
    PUSH_RESULT_SEEDED: _ClassVar[PushResult]
    PUSH_RESULT_RESTORED: _ClassVar[PushResult]

class PayloadKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PAYLOAD_KIND_UNSPECIFIED: _ClassVar[PayloadKind]
    PAYLOAD_KIND_UPDATE: _ClassVar[PayloadKind]
    PAYLOAD_KIND_SNAPSHOT: _ClassVar[PayloadKind]
CODEC_UNSPECIFIED: Codec
CODEC_FP32: Codec
CODEC_BF16: Codec
CODEC_INT8: Codec
CODEC_INT4: Codec
CODEC_FP4_E3M0: Codec
PUSH_KIND_UNSPECIFIED: PushKind
PUSH_KIND_OUTER_GRADIENT: PushKind
PUSH_KIND_SEED: PushKind
PUSH_KIND_RESTORE: PushKind
PUSH_RESULT_UNSPECIFIED: PushResult
PUSH_RESULT_ACCEPTED: PushResult
PUSH_RESULT_STALE_MERGED: PushResult
PUSH_RESULT_REFUSED_STALE: PushResult
PUSH_RESULT_SEEDED: PushResult
PUSH_RESULT_RESTORED: PushResult
PAYLOAD_KIND_UNSPECIFIED: PayloadKind
PAYLOAD_KIND_UPDATE: PayloadKind
PAYLOAD_KIND_SNAPSHOT: PayloadKind

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class ParameterManifest(_message.Message):
    __slots__ = ("tensors",)
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ...) -> None: ...

class ClusterSettings(_message.Message):
    __slots__ = ("fragments", "sync_interval_steps", "overlap_steps", "mix_alpha", "codec", "codec_block_size", "max_staleness", "fragmentation", "shards", "heartbeat_interval_seconds", "lease_seconds")
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    SYNC_INTERVAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_STEPS_FIELD_NUMBER: _ClassVar[int]
    MIX_ALPHA_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    CODEC_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTATION_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    fragments: int
    sync_interval_steps: int
    overlap_steps: int
    mix_alpha: float
    codec: Codec
    codec_block_size: int
    max_staleness: int
    fragmentation: str
    shards: int
    heartbeat_interval_seconds: float
    lease_seconds: float
    def __init__(self, fragments: _Optional[int] = ..., sync_interval_steps: _Optional[int] = ..., overlap_steps: _Optional[int] = ..., mix_alpha: _Optional[float] = ..., codec: _Optional[_Union[Codec, str]] = ..., codec_block_size: _Optional[int] = ..., max_staleness: _Optional[int] = ..., fragmentation: _Optional[str] = ..., shards: _Optional[int] = ..., heartbeat_interval_seconds: _Optional[float] = ..., lease_seconds: _Optional[float] = ...) -> None: ...

class FragmentInfo(_message.Message):
    __slots__ = ("fragment_id", "numel", "offset_step", "tensor_names", "initialized", "version", "state_hash")
    FRAGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    OFFSET_STEP_FIELD_NUMBER: _ClassVar[int]
    TENSOR_NAMES_FIELD_NUMBER: _ClassVar[int]
    INITIALIZED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_HASH_FIELD_NUMBER: _ClassVar[int]
    fragment_id: int
    numel: int
    offset_step: int
    tensor_names: _containers.RepeatedScalarFieldContainer[str]
    initialized: bool
    version: int
    state_hash: str
    def __init__(self, fragment_id: _Optional[int] = ..., numel: _Optional[int] = ..., offset_step: _Optional[int] = ..., tensor_names: _Optional[_Iterable[str]] = ..., initialized: _Optional[bool] = ..., version: _Optional[int] = ..., state_hash: _Optional[str] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("learner_id", "incarnation", "region", "manifest")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    incarnation: int
    region: str
    manifest: ParameterManifest
    def __init__(self, learner_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., region: _Optional[str] = ..., manifest: _Optional[_Union[ParameterManifest, _Mapping]] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("shard_index", "plan_digest", "fragments", "settings")
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    PLAN_DIGEST_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    shard_index: int
    plan_digest: str
    fragments: _containers.RepeatedCompositeFieldContainer[FragmentInfo]
    settings: ClusterSettings
    def __init__(self, shard_index: _Optional[int] = ..., plan_digest: _Optional[str] = ..., fragments: _Optional[_Iterable[_Union[FragmentInfo, _Mapping]]] = ..., settings: _Optional[_Union[ClusterSettings, _Mapping]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("learner_id", "incarnation", "step", "step_seconds", "tokens_per_second", "held_versions", "sync_step", "tokens", "waiting_for_fragment", "standing_still", "skipped_fragments")
    class HeldVersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    HELD_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    SYNC_STEP_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    STANDING_STILL_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    incarnation: int
    step: int
    step_seconds: float
    tokens_per_second: float
    held_versions: _containers.ScalarMap[int, int]
    sync_step: int
    tokens: int
    waiting_for_fragment: int
    standing_still: bool
    skipped_fragments: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, learner_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., step: _Optional[int] = ..., step_seconds: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., held_versions: _Optional[_Mapping[int, int]] = ..., sync_step: _Optional[int] = ..., tokens: _Optional[int] = ..., waiting_for_fragment: _Optional[int] = ..., standing_still: _Optional[bool] = ..., skipped_fragments: _Optional[_Iterable[int]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("lease_seconds", "versions", "run_tokens", "run_tokens_per_second")
    class VersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    RUN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RUN_TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    lease_seconds: float
    versions: _containers.ScalarMap[int, int]
    run_tokens: int
    run_tokens_per_second: float
    def __init__(self, lease_seconds: _Optional[float] = ..., versions: _Optional[_Mapping[int, int]] = ..., run_tokens: _Optional[int] = ..., run_tokens_per_second: _Optional[float] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("learner_id", "incarnation")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    incarnation: int
    def __init__(self, learner_id: _Optional[str] = ..., incarnation: _Optional[int] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AttendRequest(_message.Message):
    __slots__ = ("learner_id", "incarnation")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    incarnation: int
    def __init__(self, learner_id: _Optional[str] = ..., incarnation: _Optional[int] = ...) -> None: ...

class AttendResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("learner_id", "incarnation", "fragment_id", "kind", "base_version", "c_steps", "c_tokens", "step_seconds", "payload", "state_hash", "final")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    C_STEPS_FIELD_NUMBER: _ClassVar[int]
    C_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    STATE_HASH_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    incarnation: int
    fragment_id: int
    kind: PushKind
    base_version: int
    c_steps: int
    c_tokens: int
    step_seconds: float
    payload: PayloadHeader
    state_hash: str
    final: bool
    def __init__(self, learner_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., fragment_id: _Optional[int] = ..., kind: _Optional[_Union[PushKind, str]] = ..., base_version: _Optional[int] = ..., c_steps: _Optional[int] = ..., c_tokens: _Optional[int] = ..., step_seconds: _Optional[float] = ..., payload: _Optional[_Union[PayloadHeader, _Mapping]] = ..., state_hash: _Optional[str] = ..., final: _Optional[bool] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("index", "data")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    index: int
    data: bytes
    def __init__(self, index: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PayloadHeader(_message.Message):
    __slots__ = ("codec", "numel", "payload_bytes", "chunk_count", "crc32", "block_size")
    CODEC_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_COUNT_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    codec: Codec
    numel: int
    payload_bytes: int
    chunk_count: int
    crc32: int
    block_size: int
    def __init__(self, codec: _Optional[_Union[Codec, str]] = ..., numel: _Optional[int] = ..., payload_bytes: _Optional[int] = ..., chunk_count: _Optional[int] = ..., crc32: _Optional[int] = ..., block_size: _Optional[int] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    chunk: Chunk
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("result", "current_version", "staleness", "round")
    RESULT_FIELD_NUMBER: _ClassVar[int]
    CURRENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    result: PushResult
    current_version: int
    staleness: int
    round: int
    def __init__(self, result: _Optional[_Union[PushResult, str]] = ..., current_version: _Optional[int] = ..., staleness: _Optional[int] = ..., round: _Optional[int] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("learner_id", "fragment_id", "base_version", "min_version", "max_wait_seconds", "anchor_hash", "exact")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_HASH_FIELD_NUMBER: _ClassVar[int]
    EXACT_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    fragment_id: int
    base_version: int
    min_version: int
    max_wait_seconds: float
    anchor_hash: str
    exact: bool
    def __init__(self, learner_id: _Optional[str] = ..., fragment_id: _Optional[int] = ..., base_version: _Optional[int] = ..., min_version: _Optional[int] = ..., max_wait_seconds: _Optional[float] = ..., anchor_hash: _Optional[str] = ..., exact: _Optional[bool] = ...) -> None: ...

class PullItemHeader(_message.Message):
    __slots__ = ("kind", "version", "payload", "state_hash")
    KIND_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    STATE_HASH_FIELD_NUMBER: _ClassVar[int]
    kind: PayloadKind
    version: int
    payload: PayloadHeader
    state_hash: str
    def __init__(self, kind: _Optional[_Union[PayloadKind, str]] = ..., version: _Optional[int] = ..., payload: _Optional[_Union[PayloadHeader, _Mapping]] = ..., state_hash: _Optional[str] = ...) -> None: ...

class PullResponse(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PullItemHeader
    chunk: Chunk
    def __init__(self, header: _Optional[_Union[PullItemHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RoundInfo(_message.Message):
    __slots__ = ("round", "close_reason", "contributors", "closed_unix_seconds", "duration_seconds")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    CLOSE_REASON_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    CLOSED_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DURATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    round: int
    close_reason: str
    contributors: int
    closed_unix_seconds: float
    duration_seconds: float
    def __init__(self, round: _Optional[int] = ..., close_reason: _Optional[str] = ..., contributors: _Optional[int] = ..., closed_unix_seconds: _Optional[float] = ..., duration_seconds: _Optional[float] = ...) -> None: ...

class FragmentStatus(_message.Message):
    __slots__ = ("fragment_id", "numel", "initialized", "version", "state_hash", "pending_contributions", "last_round", "merged_tokens", "served")
    FRAGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    INITIALIZED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_HASH_FIELD_NUMBER: _ClassVar[int]
    PENDING_CONTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    LAST_ROUND_FIELD_NUMBER: _ClassVar[int]
    MERGED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SERVED_FIELD_NUMBER: _ClassVar[int]
    fragment_id: int
    numel: int
    initialized: bool
    version: int
    state_hash: str
    pending_contributions: int
    last_round: RoundInfo
    merged_tokens: int
    served: _containers.RepeatedCompositeFieldContainer[ServedAnchor]
    def __init__(self, fragment_id: _Optional[int] = ..., numel: _Optional[int] = ..., initialized: _Optional[bool] = ..., version: _Optional[int] = ..., state_hash: _Optional[str] = ..., pending_contributions: _Optional[int] = ..., last_round: _Optional[_Union[RoundInfo, _Mapping]] = ..., merged_tokens: _Optional[int] = ..., served: _Optional[_Iterable[_Union[ServedAnchor, _Mapping]]] = ...) -> None: ...

class ServedAnchor(_message.Message):
    __slots__ = ("learner_id", "version", "state_hash", "offset")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_HASH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    version: int
    state_hash: str
    offset: float
    def __init__(self, learner_id: _Optional[str] = ..., version: _Optional[int] = ..., state_hash: _Optional[str] = ..., offset: _Optional[float] = ...) -> None: ...

class LearnerStatus(_message.Message):
    __slots__ = ("learner_id", "region", "incarnation", "alive", "last_step", "staleness", "seconds_since_heartbeat", "tokens_per_second", "sync_step", "step_seconds", "tokens")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    SYNC_STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    region: str
    incarnation: int
    alive: bool
    last_step: int
    staleness: int
    seconds_since_heartbeat: float
    tokens_per_second: float
    sync_step: int
    step_seconds: float
    tokens: int
    def __init__(self, learner_id: _Optional[str] = ..., region: _Optional[str] = ..., incarnation: _Optional[int] = ..., alive: _Optional[bool] = ..., last_step: _Optional[int] = ..., staleness: _Optional[int] = ..., seconds_since_heartbeat: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., sync_step: _Optional[int] = ..., step_seconds: _Optional[float] = ..., tokens: _Optional[int] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("shard_index", "plan_digest", "fragments", "learners", "counters", "manifest", "certificates", "revoked_certificates")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    PLAN_DIGEST_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    LEARNERS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATES_FIELD_NUMBER: _ClassVar[int]
    REVOKED_CERTIFICATES_FIELD_NUMBER: _ClassVar[int]
    shard_index: int
    plan_digest: str
    fragments: _containers.RepeatedCompositeFieldContainer[FragmentStatus]
    learners: _containers.RepeatedCompositeFieldContainer[LearnerStatus]
    counters: _containers.ScalarMap[str, int]
    manifest: ParameterManifest
    certificates: _containers.RepeatedCompositeFieldContainer[CertificateStatus]
    revoked_certificates: int
    def __init__(self, shard_index: _Optional[int] = ..., plan_digest: _Optional[str] = ..., fragments: _Optional[_Iterable[_Union[FragmentStatus, _Mapping]]] = ..., learners: _Optional[_Iterable[_Union[LearnerStatus, _Mapping]]] = ..., counters: _Optional[_Mapping[str, int]] = ..., manifest: _Optional[_Union[ParameterManifest, _Mapping]] = ..., certificates: _Optional[_Iterable[_Union[CertificateStatus, _Mapping]]] = ..., revoked_certificates: _Optional[int] = ...) -> None: ...

class CertificateStatus(_message.Message):
    __slots__ = ("name", "serial", "expires_unix_seconds", "revoked")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SERIAL_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REVOKED_FIELD_NUMBER: _ClassVar[int]
    name: str
    serial: str
    expires_unix_seconds: float
    revoked: bool
    def __init__(self, name: _Optional[str] = ..., serial: _Optional[str] = ..., expires_unix_seconds: _Optional[float] = ..., revoked: _Optional[bool] = ...) -> None: ...
