from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Priority(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRIORITY_UNSPECIFIED: _ClassVar[Priority]
    PRIORITY_LOW: _ClassVar[Priority]
    PRIORITY_NORMAL: _ClassVar[Priority]
    PRIORITY_HIGH: _ClassVar[Priority]

class EventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_KIND_UNSPECIFIED: _ClassVar[EventKind]
    OPEN: _ClassVar[EventKind]
    COMPUTE_REQUEST: _ClassVar[EventKind]
    COMPUTE_DONE: _ClassVar[EventKind]
    COMM_BEGIN: _ClassVar[EventKind]
    COMM_END: _ClassVar[EventKind]
    HEARTBEAT: _ClassVar[EventKind]
    LEASE_RELEASED: _ClassVar[EventKind]
    HANDOVER_READY: _ClassVar[EventKind]
    BATCH: _ClassVar[EventKind]
    MEMORY_CAP_HIT: _ClassVar[EventKind]

class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PHASE_UNSPECIFIED: _ClassVar[Phase]
    IDLE: _ClassVar[Phase]
    WAITING: _ClassVar[Phase]
    COMPUTE: _ClassVar[Phase]
    COMM: _ClassVar[Phase]
    OTHER: _ClassVar[Phase]
    SUSPENDED: _ClassVar[Phase]
    OVERDUE: _ClassVar[Phase]

class Adapt(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ADAPT_UNCHANGED: _ClassVar[Adapt]
    ADAPT_ON: _ClassVar[Adapt]
    ADAPT_OFF: _ClassVar[Adapt]
PRIORITY_UNSPECIFIED: Priority
PRIORITY_LOW: Priority
PRIORITY_NORMAL: Priority
PRIORITY_HIGH: Priority
EVENT_KIND_UNSPECIFIED: EventKind
OPEN: EventKind
COMPUTE_REQUEST: EventKind
COMPUTE_DONE: EventKind
COMM_BEGIN: EventKind
COMM_END: EventKind
HEARTBEAT: EventKind
LEASE_RELEASED: EventKind
HANDOVER_READY: EventKind
BATCH: EventKind
MEMORY_CAP_HIT: EventKind
PHASE_UNSPECIFIED: Phase
IDLE: Phase
WAITING: Phase
COMPUTE: Phase
COMM: Phase
OTHER: Phase
SUSPENDED: Phase
OVERDUE: Phase
ADAPT_UNCHANGED: Adapt
ADAPT_ON: Adapt
ADAPT_OFF: Adapt

class RankIdentity(_message.Message):
    __slots__ = ("job_id", "job_name", "rank", "local_rank", "world_size", "local_size", "node", "device", "pid", "framework")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_NAME_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    FRAMEWORK_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    job_name: str
    rank: int
    local_rank: int
    world_size: int
    local_size: int
    node: str
    device: int
    pid: int
    framework: str
    def __init__(self, job_id: _Optional[str] = ..., job_name: _Optional[str] = ..., rank: _Optional[int] = ..., local_rank: _Optional[int] = ..., world_size: _Optional[int] = ..., local_size: _Optional[int] = ..., node: _Optional[str] = ..., device: _Optional[int] = ..., pid: _Optional[int] = ..., framework: _Optional[str] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("protocol_version", "identity", "accepts_leases", "priority", "accepts_preempt", "accepts_handover")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_LEASES_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_PREEMPT_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_HANDOVER_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    identity: RankIdentity
    accepts_leases: bool
    priority: Priority
    accepts_preempt: bool
    accepts_handover: bool
    def __init__(self, protocol_version: _Optional[int] = ..., identity: _Optional[_Union[RankIdentity, _Mapping]] = ..., accepts_leases: _Optional[bool] = ..., priority: _Optional[_Union[Priority, str]] = ..., accepts_preempt: _Optional[bool] = ..., accepts_handover: _Optional[bool] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("session_id", "node", "device", "cpu_affinity", "heartbeat_interval_s", "policy", "policy_blocks", "session_socket")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    CPU_AFFINITY_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    POLICY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SESSION_SOCKET_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    node: str
    device: int
    cpu_affinity: _containers.RepeatedScalarFieldContainer[int]
    heartbeat_interval_s: float
    policy: str
    policy_blocks: bool
    session_socket: str
    def __init__(self, session_id: _Optional[str] = ..., node: _Optional[str] = ..., device: _Optional[int] = ..., cpu_affinity: _Optional[_Iterable[int]] = ..., heartbeat_interval_s: _Optional[float] = ..., policy: _Optional[str] = ..., policy_blocks: _Optional[bool] = ..., session_socket: _Optional[str] = ...) -> None: ...

class JobClassUpdate(_message.Message):
    __slots__ = ("priority", "weight", "note")
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    priority: Priority
    weight: float
    note: str
    def __init__(self, priority: _Optional[_Union[Priority, str]] = ..., weight: _Optional[float] = ..., note: _Optional[str] = ...) -> None: ...

class Preempt(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RankEvent(_message.Message):
    __slots__ = ("kind", "session_id", "iteration", "seq", "duration_s", "comm_begins", "no_wait", "requested", "comm_s", "batch", "ago_s", "handover_ticket", "yields", "memory_bytes")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    COMM_BEGINS_FIELD_NUMBER: _ClassVar[int]
    NO_WAIT_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_FIELD_NUMBER: _ClassVar[int]
    COMM_S_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    AGO_S_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_TICKET_FIELD_NUMBER: _ClassVar[int]
    YIELDS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    kind: EventKind
    session_id: str
    iteration: int
    seq: int
    duration_s: float
    comm_begins: bool
    no_wait: bool
    requested: bool
    comm_s: float
    batch: _containers.RepeatedCompositeFieldContainer[RankEvent]
    ago_s: float
    handover_ticket: int
    yields: bool
    memory_bytes: int
    def __init__(self, kind: _Optional[_Union[EventKind, str]] = ..., session_id: _Optional[str] = ..., iteration: _Optional[int] = ..., seq: _Optional[int] = ..., duration_s: _Optional[float] = ..., comm_begins: _Optional[bool] = ..., no_wait: _Optional[bool] = ..., requested: _Optional[bool] = ..., comm_s: _Optional[float] = ..., batch: _Optional[_Iterable[_Union[RankEvent, _Mapping]]] = ..., ago_s: _Optional[float] = ..., handover_ticket: _Optional[int] = ..., yields: _Optional[bool] = ..., memory_bytes: _Optional[int] = ...) -> None: ...

class Directive(_message.Message):
    __slots__ = ("grant", "policy", "lease", "error", "share", "alive", "job_class", "preempt", "handover_page")
    GRANT_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    JOB_CLASS_FIELD_NUMBER: _ClassVar[int]
    PREEMPT_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_PAGE_FIELD_NUMBER: _ClassVar[int]
    grant: Grant
    policy: PolicyUpdate
    lease: Lease
    error: SessionError
    share: DeviceShare
    alive: Alive
    job_class: JobClassUpdate
    preempt: Preempt
    handover_page: HandoverPage
    def __init__(self, grant: _Optional[_Union[Grant, _Mapping]] = ..., policy: _Optional[_Union[PolicyUpdate, _Mapping]] = ..., lease: _Optional[_Union[Lease, _Mapping]] = ..., error: _Optional[_Union[SessionError, _Mapping]] = ..., share: _Optional[_Union[DeviceShare, _Mapping]] = ..., alive: _Optional[_Union[Alive, _Mapping]] = ..., job_class: _Optional[_Union[JobClassUpdate, _Mapping]] = ..., preempt: _Optional[_Union[Preempt, _Mapping]] = ..., handover_page: _Optional[_Union[HandoverPage, _Mapping]] = ...) -> None: ...

class HandoverPage(_message.Message):
    __slots__ = ("page", "own")
    PAGE_FIELD_NUMBER: _ClassVar[int]
    OWN_FIELD_NUMBER: _ClassVar[int]
    page: int
    own: bool
    def __init__(self, page: _Optional[int] = ..., own: _Optional[bool] = ...) -> None: ...

class Alive(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DeviceShare(_message.Message):
    __slots__ = ("other_ranks", "handover", "outranked", "memory_cap_bytes", "memory_cap_why")
    OTHER_RANKS_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_FIELD_NUMBER: _ClassVar[int]
    OUTRANKED_FIELD_NUMBER: _ClassVar[int]
    MEMORY_CAP_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_CAP_WHY_FIELD_NUMBER: _ClassVar[int]
    other_ranks: int
    handover: bool
    outranked: bool
    memory_cap_bytes: int
    memory_cap_why: str
    def __init__(self, other_ranks: _Optional[int] = ..., handover: _Optional[bool] = ..., outranked: _Optional[bool] = ..., memory_cap_bytes: _Optional[int] = ..., memory_cap_why: _Optional[str] = ...) -> None: ...

class SessionError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("held",)
    HELD_FIELD_NUMBER: _ClassVar[int]
    held: bool
    def __init__(self, held: _Optional[bool] = ...) -> None: ...

class Grant(_message.Message):
    __slots__ = ("seq", "iteration", "waited_s", "after_page", "after_ticket")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    WAITED_S_FIELD_NUMBER: _ClassVar[int]
    AFTER_PAGE_FIELD_NUMBER: _ClassVar[int]
    AFTER_TICKET_FIELD_NUMBER: _ClassVar[int]
    seq: int
    iteration: int
    waited_s: float
    after_page: int
    after_ticket: int
    def __init__(self, seq: _Optional[int] = ..., iteration: _Optional[int] = ..., waited_s: _Optional[float] = ..., after_page: _Optional[int] = ..., after_ticket: _Optional[int] = ...) -> None: ...

class PolicyUpdate(_message.Message):
    __slots__ = ("policy", "policy_blocks")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    POLICY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    policy: str
    policy_blocks: bool
    def __init__(self, policy: _Optional[str] = ..., policy_blocks: _Optional[bool] = ...) -> None: ...

class RankState(_message.Message):
    __slots__ = ("job_id", "job_name", "rank", "local_rank", "pid", "phase", "iteration", "mean_compute_s", "mean_comm_s", "wait_fraction", "cpu_percent", "rss_bytes", "gpu_memory_bytes", "since_s", "user", "priority", "weight", "handover", "framework", "device", "memory_cap_bytes", "memory_note")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_NAME_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    MEAN_COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    MEAN_COMM_S_FIELD_NUMBER: _ClassVar[int]
    WAIT_FRACTION_FIELD_NUMBER: _ClassVar[int]
    CPU_PERCENT_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    SINCE_S_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_FIELD_NUMBER: _ClassVar[int]
    FRAMEWORK_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_CAP_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_NOTE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    job_name: str
    rank: int
    local_rank: int
    pid: int
    phase: Phase
    iteration: int
    mean_compute_s: float
    mean_comm_s: float
    wait_fraction: float
    cpu_percent: float
    rss_bytes: int
    gpu_memory_bytes: int
    since_s: float
    user: str
    priority: Priority
    weight: float
    handover: str
    framework: str
    device: int
    memory_cap_bytes: int
    memory_note: str
    def __init__(self, job_id: _Optional[str] = ..., job_name: _Optional[str] = ..., rank: _Optional[int] = ..., local_rank: _Optional[int] = ..., pid: _Optional[int] = ..., phase: _Optional[_Union[Phase, str]] = ..., iteration: _Optional[int] = ..., mean_compute_s: _Optional[float] = ..., mean_comm_s: _Optional[float] = ..., wait_fraction: _Optional[float] = ..., cpu_percent: _Optional[float] = ..., rss_bytes: _Optional[int] = ..., gpu_memory_bytes: _Optional[int] = ..., since_s: _Optional[float] = ..., user: _Optional[str] = ..., priority: _Optional[_Union[Priority, str]] = ..., weight: _Optional[float] = ..., handover: _Optional[str] = ..., framework: _Optional[str] = ..., device: _Optional[int] = ..., memory_cap_bytes: _Optional[int] = ..., memory_note: _Optional[str] = ...) -> None: ...

class DeviceState(_message.Message):
    __slots__ = ("index", "kind", "name", "draining", "holders", "waiting", "others", "utilization", "memory_used_bytes", "memory_total_bytes", "order", "refused_while_draining", "sharing", "sharing_reason", "isolation", "memory_free_bytes")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    OTHERS_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    REFUSED_WHILE_DRAINING_FIELD_NUMBER: _ClassVar[int]
    SHARING_FIELD_NUMBER: _ClassVar[int]
    SHARING_REASON_FIELD_NUMBER: _ClassVar[int]
    ISOLATION_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    index: int
    kind: str
    name: str
    draining: bool
    holders: _containers.RepeatedCompositeFieldContainer[RankState]
    waiting: _containers.RepeatedCompositeFieldContainer[RankState]
    others: _containers.RepeatedCompositeFieldContainer[RankState]
    utilization: float
    memory_used_bytes: int
    memory_total_bytes: int
    order: _containers.RepeatedScalarFieldContainer[str]
    refused_while_draining: int
    sharing: str
    sharing_reason: str
    isolation: Isolation
    memory_free_bytes: int
    def __init__(self, index: _Optional[int] = ..., kind: _Optional[str] = ..., name: _Optional[str] = ..., draining: _Optional[bool] = ..., holders: _Optional[_Iterable[_Union[RankState, _Mapping]]] = ..., waiting: _Optional[_Iterable[_Union[RankState, _Mapping]]] = ..., others: _Optional[_Iterable[_Union[RankState, _Mapping]]] = ..., utilization: _Optional[float] = ..., memory_used_bytes: _Optional[int] = ..., memory_total_bytes: _Optional[int] = ..., order: _Optional[_Iterable[str]] = ..., refused_while_draining: _Optional[int] = ..., sharing: _Optional[str] = ..., sharing_reason: _Optional[str] = ..., isolation: _Optional[_Union[Isolation, _Mapping]] = ..., memory_free_bytes: _Optional[int] = ...) -> None: ...

class Isolation(_message.Message):
    __slots__ = ("window", "target", "budget", "reference_s", "current_s", "lower_share", "kept")
    class LowerShareEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_S_FIELD_NUMBER: _ClassVar[int]
    CURRENT_S_FIELD_NUMBER: _ClassVar[int]
    LOWER_SHARE_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    window: str
    target: float
    budget: float
    reference_s: float
    current_s: float
    lower_share: _containers.ScalarMap[str, float]
    kept: float
    def __init__(self, window: _Optional[str] = ..., target: _Optional[float] = ..., budget: _Optional[float] = ..., reference_s: _Optional[float] = ..., current_s: _Optional[float] = ..., lower_share: _Optional[_Mapping[str, float]] = ..., kept: _Optional[float] = ...) -> None: ...

class QueueRequest(_message.Message):
    __slots__ = ("protocol_version", "device")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    device: int
    def __init__(self, protocol_version: _Optional[int] = ..., device: _Optional[int] = ...) -> None: ...

class QueueState(_message.Message):
    __slots__ = ("node", "policy", "uptime_s", "devices", "overdue_total", "connections", "max_connections")
    NODE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    OVERDUE_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    node: str
    policy: str
    uptime_s: float
    devices: _containers.RepeatedCompositeFieldContainer[DeviceState]
    overdue_total: int
    connections: int
    max_connections: int
    def __init__(self, node: _Optional[str] = ..., policy: _Optional[str] = ..., uptime_s: _Optional[float] = ..., devices: _Optional[_Iterable[_Union[DeviceState, _Mapping]]] = ..., overdue_total: _Optional[int] = ..., connections: _Optional[int] = ..., max_connections: _Optional[int] = ...) -> None: ...

class JobsRequest(_message.Message):
    __slots__ = ("protocol_version",)
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    def __init__(self, protocol_version: _Optional[int] = ...) -> None: ...

class JobState(_message.Message):
    __slots__ = ("job_id", "job_name", "world_size", "ranks", "registered_s", "priority", "weight", "class_set_by", "framework")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_NAME_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_S_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    CLASS_SET_BY_FIELD_NUMBER: _ClassVar[int]
    FRAMEWORK_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    job_name: str
    world_size: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankState]
    registered_s: float
    priority: Priority
    weight: float
    class_set_by: str
    framework: str
    def __init__(self, job_id: _Optional[str] = ..., job_name: _Optional[str] = ..., world_size: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankState, _Mapping]]] = ..., registered_s: _Optional[float] = ..., priority: _Optional[_Union[Priority, str]] = ..., weight: _Optional[float] = ..., class_set_by: _Optional[str] = ..., framework: _Optional[str] = ...) -> None: ...

class JobClassRequest(_message.Message):
    __slots__ = ("protocol_version", "job", "priority", "weight")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    job: str
    priority: Priority
    weight: float
    def __init__(self, protocol_version: _Optional[int] = ..., job: _Optional[str] = ..., priority: _Optional[_Union[Priority, str]] = ..., weight: _Optional[float] = ...) -> None: ...

class JobList(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobState]
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobState, _Mapping]]] = ...) -> None: ...

class PolicyRequest(_message.Message):
    __slots__ = ("protocol_version", "name", "adapt", "handover", "protect")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADAPT_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_FIELD_NUMBER: _ClassVar[int]
    PROTECT_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    name: str
    adapt: Adapt
    handover: Adapt
    protect: float
    def __init__(self, protocol_version: _Optional[int] = ..., name: _Optional[str] = ..., adapt: _Optional[_Union[Adapt, str]] = ..., handover: _Optional[_Union[Adapt, str]] = ..., protect: _Optional[float] = ...) -> None: ...

class PolicyInfo(_message.Message):
    __slots__ = ("name", "available", "adapt", "handover", "protect")
    NAME_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    ADAPT_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_FIELD_NUMBER: _ClassVar[int]
    PROTECT_FIELD_NUMBER: _ClassVar[int]
    name: str
    available: _containers.RepeatedScalarFieldContainer[str]
    adapt: bool
    handover: bool
    protect: float
    def __init__(self, name: _Optional[str] = ..., available: _Optional[_Iterable[str]] = ..., adapt: _Optional[bool] = ..., handover: _Optional[bool] = ..., protect: _Optional[float] = ...) -> None: ...

class DeviceRequest(_message.Message):
    __slots__ = ("protocol_version", "device")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    device: int
    def __init__(self, protocol_version: _Optional[int] = ..., device: _Optional[int] = ...) -> None: ...

class DeviceAck(_message.Message):
    __slots__ = ("device", "draining")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    device: int
    draining: bool
    def __init__(self, device: _Optional[int] = ..., draining: _Optional[bool] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("protocol_version", "device", "job")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    device: int
    job: str
    def __init__(self, protocol_version: _Optional[int] = ..., device: _Optional[int] = ..., job: _Optional[str] = ...) -> None: ...

class EvictReply(_message.Message):
    __slots__ = ("done",)
    DONE_FIELD_NUMBER: _ClassVar[int]
    done: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, done: _Optional[_Iterable[str]] = ...) -> None: ...
