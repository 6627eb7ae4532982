from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RoundKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROUND_KIND_UNSPECIFIED: _ClassVar[RoundKind]
    ROUND_KIND_LOCAL: _ClassVar[RoundKind]
    ROUND_KIND_GLOBAL: _ClassVar[RoundKind]
    ROUND_KIND_FINAL: _ClassVar[RoundKind]

class BufferKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BUFFER_KIND_UNSPECIFIED: _ClassVar[BufferKind]
    BUFFER_KIND_GLOBAL_LEADER: _ClassVar[BufferKind]
    BUFFER_KIND_CENTER: _ClassVar[BufferKind]
    BUFFER_KIND_NODE_SUM: _ClassVar[BufferKind]
    BUFFER_KIND_AVERAGE: _ClassVar[BufferKind]
    BUFFER_KIND_CENTER_DELTA: _ClassVar[BufferKind]
    BUFFER_KIND_MAIL: _ClassVar[BufferKind]

class WireFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WIRE_FORMAT_UNSPECIFIED: _ClassVar[WireFormat]
    WIRE_FORMAT_BFLOAT16: _ClassVar[WireFormat]
ROUND_KIND_UNSPECIFIED: RoundKind
ROUND_KIND_LOCAL: RoundKind
ROUND_KIND_GLOBAL: RoundKind
ROUND_KIND_FINAL: RoundKind
BUFFER_KIND_UNSPECIFIED: BufferKind
BUFFER_KIND_GLOBAL_LEADER: BufferKind
BUFFER_KIND_CENTER: BufferKind
BUFFER_KIND_NODE_SUM: BufferKind
BUFFER_KIND_AVERAGE: BufferKind
BUFFER_KIND_CENTER_DELTA: BufferKind
BUFFER_KIND_MAIL: BufferKind
WIRE_FORMAT_UNSPECIFIED: WireFormat
WIRE_FORMAT_BFLOAT16: WireFormat

class NodeId(_message.Message):
    __slots__ = ("job_id", "node_index", "session")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_INDEX_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    node_index: int
    session: int
    def __init__(self, job_id: _Optional[str] = ..., node_index: _Optional[int] = ..., session: _Optional[int] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("node", "num_workers", "param_count", "algorithm", "num_groups", "resume_session", "held_credits", "unreported", "seq", "unanswered_seq", "unanswered_steps", "replaces_session", "data_address")
    NODE_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    PARAM_COUNT_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    RESUME_SESSION_FIELD_NUMBER: _ClassVar[int]
    HELD_CREDITS_FIELD_NUMBER: _ClassVar[int]
    UNREPORTED_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    UNANSWERED_SEQ_FIELD_NUMBER: _ClassVar[int]
    UNANSWERED_STEPS_FIELD_NUMBER: _ClassVar[int]
    REPLACES_SESSION_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    node: NodeId
    num_workers: int
    param_count: int
    algorithm: str
    num_groups: int
    resume_session: int
    held_credits: int
    unreported: int
    seq: int
    unanswered_seq: int
    unanswered_steps: int
    replaces_session: int
    data_address: str
    def __init__(self, node: _Optional[_Union[NodeId, _Mapping]] = ..., num_workers: _Optional[int] = ..., param_count: _Optional[int] = ..., algorithm: _Optional[str] = ..., num_groups: _Optional[int] = ..., resume_session: _Optional[int] = ..., held_credits: _Optional[int] = ..., unreported: _Optional[int] = ..., seq: _Optional[int] = ..., unanswered_seq: _Optional[int] = ..., unanswered_steps: _Optional[int] = ..., replaces_session: _Optional[int] = ..., data_address: _Optional[str] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("session", "seed_center", "counter", "epoch", "round_id", "session_port", "bulk_port")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    SEED_CENTER_FIELD_NUMBER: _ClassVar[int]
    COUNTER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_PORT_FIELD_NUMBER: _ClassVar[int]
    BULK_PORT_FIELD_NUMBER: _ClassVar[int]
    session: int
    seed_center: bool
    counter: int
    epoch: int
    round_id: int
    session_port: int
    bulk_port: int
    def __init__(self, session: _Optional[int] = ..., seed_center: _Optional[bool] = ..., counter: _Optional[int] = ..., epoch: _Optional[int] = ..., round_id: _Optional[int] = ..., session_port: _Optional[int] = ..., bulk_port: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node", "report")
    NODE_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    node: NodeId
    report: NodeReport
    def __init__(self, node: _Optional[_Union[NodeId, _Mapping]] = ..., report: _Optional[_Union[NodeReport, _Mapping]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("counter", "epoch", "stopped", "nodes_alive", "nodes_missing", "job_started", "has_leader", "leader", "leader_node", "rounds", "evaluations_held", "aborted_reduce")
    COUNTER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    NODES_ALIVE_FIELD_NUMBER: _ClassVar[int]
    NODES_MISSING_FIELD_NUMBER: _ClassVar[int]
    JOB_STARTED_FIELD_NUMBER: _ClassVar[int]
    HAS_LEADER_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    LEADER_NODE_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    EVALUATIONS_HELD_FIELD_NUMBER: _ClassVar[int]
    ABORTED_REDUCE_FIELD_NUMBER: _ClassVar[int]
    counter: int
    epoch: int
    stopped: str
    nodes_alive: int
    nodes_missing: _containers.RepeatedScalarFieldContainer[int]
    job_started: bool
    has_leader: bool
    leader: Candidate
    leader_node: int
    rounds: int
    evaluations_held: int
    aborted_reduce: int
    def __init__(self, counter: _Optional[int] = ..., epoch: _Optional[int] = ..., stopped: _Optional[str] = ..., nodes_alive: _Optional[int] = ..., nodes_missing: _Optional[_Iterable[int]] = ..., job_started: _Optional[bool] = ..., has_leader: _Optional[bool] = ..., leader: _Optional[_Union[Candidate, _Mapping]] = ..., leader_node: _Optional[int] = ..., rounds: _Optional[int] = ..., evaluations_held: _Optional[int] = ..., aborted_reduce: _Optional[int] = ...) -> None: ...

class WorkerStat(_message.Message):
    __slots__ = ("worker_id", "iterations", "loss", "distance", "distance_to", "resets", "respawns", "training", "round_id")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    DISTANCE_FIELD_NUMBER: _ClassVar[int]
    DISTANCE_TO_FIELD_NUMBER: _ClassVar[int]
    RESETS_FIELD_NUMBER: _ClassVar[int]
    RESPAWNS_FIELD_NUMBER: _ClassVar[int]
    TRAINING_FIELD_NUMBER: _ClassVar[int]
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    iterations: int
    loss: float
    distance: float
    distance_to: str
    resets: int
    respawns: int
    training: bool
    round_id: int
    def __init__(self, worker_id: _Optional[int] = ..., iterations: _Optional[int] = ..., loss: _Optional[float] = ..., distance: _Optional[float] = ..., distance_to: _Optional[str] = ..., resets: _Optional[int] = ..., respawns: _Optional[int] = ..., training: _Optional[bool] = ..., round_id: _Optional[int] = ...) -> None: ...

class Evaluation(_message.Message):
    __slots__ = ("round_id", "iteration", "target", "metric", "value", "worker_id")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    METRIC_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    round_id: int
    iteration: int
    target: str
    metric: str
    value: float
    worker_id: int
    def __init__(self, round_id: _Optional[int] = ..., iteration: _Optional[int] = ..., target: _Optional[str] = ..., metric: _Optional[str] = ..., value: _Optional[float] = ..., worker_id: _Optional[int] = ...) -> None: ...

class NodeReport(_message.Message):
    __slots__ = ("steps", "rate", "workers_training", "reattaches", "workers", "has_local_leader", "local_leader", "evaluations_from", "evaluations")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    RATE_FIELD_NUMBER: _ClassVar[int]
    WORKERS_TRAINING_FIELD_NUMBER: _ClassVar[int]
    REATTACHES_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    HAS_LOCAL_LEADER_FIELD_NUMBER: _ClassVar[int]
    LOCAL_LEADER_FIELD_NUMBER: _ClassVar[int]
    EVALUATIONS_FROM_FIELD_NUMBER: _ClassVar[int]
    EVALUATIONS_FIELD_NUMBER: _ClassVar[int]
    steps: int
    rate: float
    workers_training: int
    reattaches: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStat]
    has_local_leader: bool
    local_leader: Candidate
    evaluations_from: int
    evaluations: _containers.RepeatedCompositeFieldContainer[Evaluation]
    def __init__(self, steps: _Optional[int] = ..., rate: _Optional[float] = ..., workers_training: _Optional[int] = ..., reattaches: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerStat, _Mapping]]] = ..., has_local_leader: _Optional[bool] = ..., local_leader: _Optional[_Union[Candidate, _Mapping]] = ..., evaluations_from: _Optional[int] = ..., evaluations: _Optional[_Iterable[_Union[Evaluation, _Mapping]]] = ...) -> None: ...

class AcquireCreditsRequest(_message.Message):
    __slots__ = ("node", "consumed", "late_consumed", "released", "want", "last_round_seen", "max_wait_ms", "seq", "used_ms")
    NODE_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_FIELD_NUMBER: _ClassVar[int]
    LATE_CONSUMED_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    WANT_FIELD_NUMBER: _ClassVar[int]
    LAST_ROUND_SEEN_FIELD_NUMBER: _ClassVar[int]
    MAX_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    USED_MS_FIELD_NUMBER: _ClassVar[int]
    node: NodeId
    consumed: int
    late_consumed: int
    released: int
    want: int
    last_round_seen: int
    max_wait_ms: int
    seq: int
    used_ms: int
    def __init__(self, node: _Optional[_Union[NodeId, _Mapping]] = ..., consumed: _Optional[int] = ..., late_consumed: _Optional[int] = ..., released: _Optional[int] = ..., want: _Optional[int] = ..., last_round_seen: _Optional[int] = ..., max_wait_ms: _Optional[int] = ..., seq: _Optional[int] = ..., used_ms: _Optional[int] = ...) -> None: ...

class Round(_message.Message):
    __slots__ = ("id", "kind", "iteration")
    ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    id: int
    kind: RoundKind
    iteration: int
    def __init__(self, id: _Optional[int] = ..., kind: _Optional[_Union[RoundKind, str]] = ..., iteration: _Optional[int] = ...) -> None: ...

class AcquireCreditsResponse(_message.Message):
    __slots__ = ("grant", "round", "counter", "epoch", "stopped")
    GRANT_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    COUNTER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    grant: int
    round: Round
    counter: int
    epoch: int
    stopped: str
    def __init__(self, grant: _Optional[int] = ..., round: _Optional[_Union[Round, _Mapping]] = ..., counter: _Optional[int] = ..., epoch: _Optional[int] = ..., stopped: _Optional[str] = ...) -> None: ...

class Candidate(_message.Message):
    __slots__ = ("worker_id", "loss")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    loss: float
    def __init__(self, worker_id: _Optional[int] = ..., loss: _Optional[float] = ...) -> None: ...

class ReportRoundRequest(_message.Message):
    __slots__ = ("node", "round_id", "best", "has_best", "participants", "weight", "then_pull", "then_pull_wire", "then_push")
    NODE_FIELD_NUMBER: _ClassVar[int]
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    BEST_FIELD_NUMBER: _ClassVar[int]
    HAS_BEST_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    THEN_PULL_FIELD_NUMBER: _ClassVar[int]
    THEN_PULL_WIRE_FIELD_NUMBER: _ClassVar[int]
    THEN_PUSH_FIELD_NUMBER: _ClassVar[int]
    node: NodeId
    round_id: int
    best: Candidate
    has_best: bool
    participants: int
    weight: float
    then_pull: BufferKind
    then_pull_wire: WireFormat
    then_push: SessionUpload
    def __init__(self, node: _Optional[_Union[NodeId, _Mapping]] = ..., round_id: _Optional[int] = ..., best: _Optional[_Union[Candidate, _Mapping]] = ..., has_best: _Optional[bool] = ..., participants: _Optional[int] = ..., weight: _Optional[float] = ..., then_pull: _Optional[_Union[BufferKind, str]] = ..., then_pull_wire: _Optional[_Union[WireFormat, str]] = ..., then_push: _Optional[_Union[SessionUpload, _Mapping]] = ...) -> None: ...

class ReportRoundResponse(_message.Message):
    __slots__ = ("missed", "has_leader", "leader", "leader_node", "participants", "evaluate", "checkpoint", "stopped", "route", "node_count", "download", "download_code", "download_details", "pushed", "push_code", "push_details")
    MISSED_FIELD_NUMBER: _ClassVar[int]
    HAS_LEADER_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    LEADER_NODE_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANTS_FIELD_NUMBER: _ClassVar[int]
    EVALUATE_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    NODE_COUNT_FIELD_NUMBER: _ClassVar[int]
    DOWNLOAD_FIELD_NUMBER: _ClassVar[int]
    DOWNLOAD_CODE_FIELD_NUMBER: _ClassVar[int]
    DOWNLOAD_DETAILS_FIELD_NUMBER: _ClassVar[int]
    PUSHED_FIELD_NUMBER: _ClassVar[int]
    PUSH_CODE_FIELD_NUMBER: _ClassVar[int]
    PUSH_DETAILS_FIELD_NUMBER: _ClassVar[int]
    missed: bool
    has_leader: bool
    leader: Candidate
    leader_node: int
    participants: int
    evaluate: bool
    checkpoint: bool
    stopped: str
    route: DataRoute
    node_count: int
    download: ParamChunk
    download_code: int
    download_details: str
    pushed: bool
    push_code: int
    push_details: str
    def __init__(self, missed: _Optional[bool] = ..., has_leader: _Optional[bool] = ..., leader: _Optional[_Union[Candidate, _Mapping]] = ..., leader_node: _Optional[int] = ..., participants: _Optional[int] = ..., evaluate: _Optional[bool] = ..., checkpoint: _Optional[bool] = ..., stopped: _Optional[str] = ..., route: _Optional[_Union[DataRoute, _Mapping]] = ..., node_count: _Optional[int] = ..., download: _Optional[_Union[ParamChunk, _Mapping]] = ..., download_code: _Optional[int] = ..., download_details: _Optional[str] = ..., pushed: _Optional[bool] = ..., push_code: _Optional[int] = ..., push_details: _Optional[str] = ...) -> None: ...

class RouteMember(_message.Message):
    __slots__ = ("node", "parent", "address")
    NODE_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    node: int
    parent: int
    address: str
    def __init__(self, node: _Optional[int] = ..., parent: _Optional[int] = ..., address: _Optional[str] = ...) -> None: ...

class DataRoute(_message.Message):
    __slots__ = ("round_id", "epoch", "members", "feeds_server", "chunk_elements", "reduce", "total_summands", "total_weight")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    FEEDS_SERVER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    REDUCE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SUMMANDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    round_id: int
    epoch: int
    members: _containers.RepeatedCompositeFieldContainer[RouteMember]
    feeds_server: int
    chunk_elements: int
    reduce: bool
    total_summands: int
    total_weight: float
    def __init__(self, round_id: _Optional[int] = ..., epoch: _Optional[int] = ..., members: _Optional[_Iterable[_Union[RouteMember, _Mapping]]] = ..., feeds_server: _Optional[int] = ..., chunk_elements: _Optional[int] = ..., reduce: _Optional[bool] = ..., total_summands: _Optional[int] = ..., total_weight: _Optional[float] = ...) -> None: ...

class BypassRequest(_message.Message):
    __slots__ = ("node", "round_id", "epoch", "stalled", "why", "reduce")
    NODE_FIELD_NUMBER: _ClassVar[int]
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STALLED_FIELD_NUMBER: _ClassVar[int]
    WHY_FIELD_NUMBER: _ClassVar[int]
    REDUCE_FIELD_NUMBER: _ClassVar[int]
    node: NodeId
    round_id: int
    epoch: int
    stalled: int
    why: str
    reduce: bool
    def __init__(self, node: _Optional[_Union[NodeId, _Mapping]] = ..., round_id: _Optional[int] = ..., epoch: _Optional[int] = ..., stalled: _Optional[int] = ..., why: _Optional[str] = ..., reduce: _Optional[bool] = ...) -> None: ...

class DigestRequest(_message.Message):
    __slots__ = ("node", "round_id", "sha256", "center")
    NODE_FIELD_NUMBER: _ClassVar[int]
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    CENTER_FIELD_NUMBER: _ClassVar[int]
    node: NodeId
    round_id: int
    sha256: bytes
    center: bool
    def __init__(self, node: _Optional[_Union[NodeId, _Mapping]] = ..., round_id: _Optional[int] = ..., sha256: _Optional[bytes] = ..., center: _Optional[bool] = ...) -> None: ...

class DigestResponse(_message.Message):
    __slots__ = ("sha256",)
    SHA256_FIELD_NUMBER: _ClassVar[int]
    sha256: bytes
    def __init__(self, sha256: _Optional[bytes] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("node", "round_id", "buffer", "param_count", "summands", "wire_format", "weight")
    NODE_FIELD_NUMBER: _ClassVar[int]
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    PARAM_COUNT_FIELD_NUMBER: _ClassVar[int]
    SUMMANDS_FIELD_NUMBER: _ClassVar[int]
    WIRE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    node: NodeId
    round_id: int
    buffer: BufferKind
    param_count: int
    summands: int
    wire_format: WireFormat
    weight: float
    def __init__(self, node: _Optional[_Union[NodeId, _Mapping]] = ..., round_id: _Optional[int] = ..., buffer: _Optional[_Union[BufferKind, str]] = ..., param_count: _Optional[int] = ..., summands: _Optional[int] = ..., wire_format: _Optional[_Union[WireFormat, str]] = ..., weight: _Optional[float] = ...) -> None: ...

class PushParamsRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    chunk: ParamChunk
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., chunk: _Optional[_Union[ParamChunk, _Mapping]] = ...) -> None: ...

class PushParamsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ParamChunk(_message.Message):
    __slots__ = ("offset", "data", "weight")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    weight: float
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ..., weight: _Optional[float] = ...) -> None: ...

class PullParamsRequest(_message.Message):
    __slots__ = ("node", "round_id", "buffer", "chunk_elements", "wire_format")
    NODE_FIELD_NUMBER: _ClassVar[int]
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    WIRE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    node: NodeId
    round_id: int
    buffer: BufferKind
    chunk_elements: int
    wire_format: WireFormat
    def __init__(self, node: _Optional[_Union[NodeId, _Mapping]] = ..., round_id: _Optional[int] = ..., buffer: _Optional[_Union[BufferKind, str]] = ..., chunk_elements: _Optional[int] = ..., wire_format: _Optional[_Union[WireFormat, str]] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("node", "consumed", "late_consumed", "stop_job")
    NODE_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_FIELD_NUMBER: _ClassVar[int]
    LATE_CONSUMED_FIELD_NUMBER: _ClassVar[int]
    STOP_JOB_FIELD_NUMBER: _ClassVar[int]
    node: NodeId
    consumed: int
    late_consumed: int
    stop_job: str
    def __init__(self, node: _Optional[_Union[NodeId, _Mapping]] = ..., consumed: _Optional[int] = ..., late_consumed: _Optional[int] = ..., stop_job: _Optional[str] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ("counter",)
    COUNTER_FIELD_NUMBER: _ClassVar[int]
    counter: int
    def __init__(self, counter: _Optional[int] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("n", "node", "nonce", "acquire", "report", "mac", "digest", "pull", "push", "leave")
    N_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    ACQUIRE_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    LEAVE_FIELD_NUMBER: _ClassVar[int]
    n: int
    node: NodeId
    nonce: bytes
    acquire: bytes
    report: bytes
    mac: bytes
    digest: bytes
    pull: bytes
    push: bytes
    leave: bytes
    def __init__(self, n: _Optional[int] = ..., node: _Optional[_Union[NodeId, _Mapping]] = ..., nonce: _Optional[bytes] = ..., acquire: _Optional[bytes] = ..., report: _Optional[bytes] = ..., mac: _Optional[bytes] = ..., digest: _Optional[bytes] = ..., pull: _Optional[bytes] = ..., push: _Optional[bytes] = ..., leave: _Optional[bytes] = ...) -> None: ...

class SessionUpload(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class SessionReply(_message.Message):
    __slots__ = ("n", "acquire", "report", "code", "details", "digest", "pull", "push", "leave")
    N_FIELD_NUMBER: _ClassVar[int]
    ACQUIRE_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    LEAVE_FIELD_NUMBER: _ClassVar[int]
    n: int
    acquire: AcquireCreditsResponse
    report: ReportRoundResponse
    code: int
    details: str
    digest: DigestResponse
    pull: ParamChunk
    push: PushParamsResponse
    leave: LeaveResponse
    def __init__(self, n: _Optional[int] = ..., acquire: _Optional[_Union[AcquireCreditsResponse, _Mapping]] = ..., report: _Optional[_Union[ReportRoundResponse, _Mapping]] = ..., code: _Optional[int] = ..., details: _Optional[str] = ..., digest: _Optional[_Union[DigestResponse, _Mapping]] = ..., pull: _Optional[_Union[ParamChunk, _Mapping]] = ..., push: _Optional[_Union[PushParamsResponse, _Mapping]] = ..., leave: _Optional[_Union[LeaveResponse, _Mapping]] = ...) -> None: ...
