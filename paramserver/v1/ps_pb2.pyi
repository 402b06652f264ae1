from google.protobuf import descriptor_pb2 as _descriptor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]

class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODE_UNSPECIFIED: _ClassVar[Mode]
    SYNC: _ClassVar[Mode]
    ASYNC: _ClassVar[Mode]
    SSP: _ClassVar[Mode]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
BFLOAT16: DType
FLOAT16: DType
MODE_UNSPECIFIED: Mode
SYNC: Mode
ASYNC: Mode
SSP: Mode

class Bound(_message.Message):
    __slots__ = ()
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    max_bytes: _descriptor.FieldDescriptor
    MAX_ITEMS_FIELD_NUMBER: _ClassVar[int]
    max_items: _descriptor.FieldDescriptor
    def __init__(self) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape", "buffer")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    buffer: bool
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., buffer: _Optional[bool] = ...) -> None: ...

class TableSpec(_message.Message):
    __slots__ = ("name", "dim", "num_embeddings", "init", "init_scale", "seed", "optimizer", "lr", "admit_after", "admit_probability", "evict_after_versions", "evict_after_seconds", "capacity")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    NUM_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    INIT_FIELD_NUMBER: _ClassVar[int]
    INIT_SCALE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    ADMIT_AFTER_FIELD_NUMBER: _ClassVar[int]
    ADMIT_PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    EVICT_AFTER_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    EVICT_AFTER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    name: str
    dim: int
    num_embeddings: int
    init: str
    init_scale: float
    seed: int
    optimizer: str
    lr: float
    admit_after: int
    admit_probability: float
    evict_after_versions: int
    evict_after_seconds: float
    capacity: int
    def __init__(self, name: _Optional[str] = ..., dim: _Optional[int] = ..., num_embeddings: _Optional[int] = ..., init: _Optional[str] = ..., init_scale: _Optional[float] = ..., seed: _Optional[int] = ..., optimizer: _Optional[str] = ..., lr: _Optional[float] = ..., admit_after: _Optional[int] = ..., admit_probability: _Optional[float] = ..., evict_after_versions: _Optional[int] = ..., evict_after_seconds: _Optional[float] = ..., capacity: _Optional[int] = ...) -> None: ...

class Rows(_message.Message):
    __slots__ = ("table", "count", "ids", "values")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    table: int
    count: int
    ids: bytes
    values: bytes
    def __init__(self, table: _Optional[int] = ..., count: _Optional[int] = ..., ids: _Optional[bytes] = ..., values: _Optional[bytes] = ...) -> None: ...

class Piece(_message.Message):
    __slots__ = ("name", "start", "length")
    NAME_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    name: str
    start: int
    length: int
    def __init__(self, name: _Optional[str] = ..., start: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("piece", "offset", "data")
    PIECE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    piece: int
    offset: int
    data: bytes
    def __init__(self, piece: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class JobInfo(_message.Message):
    __slots__ = ("mode", "workers", "optimizer", "lr", "job_name", "lr_schedule", "warmup_versions", "warmup_start_factor", "decay_versions", "min_lr", "step_every", "gamma")
    MODE_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    JOB_NAME_FIELD_NUMBER: _ClassVar[int]
    LR_SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    WARMUP_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    WARMUP_START_FACTOR_FIELD_NUMBER: _ClassVar[int]
    DECAY_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    MIN_LR_FIELD_NUMBER: _ClassVar[int]
    STEP_EVERY_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    mode: Mode
    workers: int
    optimizer: str
    lr: float
    job_name: str
    lr_schedule: str
    warmup_versions: int
    warmup_start_factor: float
    decay_versions: int
    min_lr: float
    step_every: int
    gamma: float
    def __init__(self, mode: _Optional[_Union[Mode, str]] = ..., workers: _Optional[int] = ..., optimizer: _Optional[str] = ..., lr: _Optional[float] = ..., job_name: _Optional[str] = ..., lr_schedule: _Optional[str] = ..., warmup_versions: _Optional[int] = ..., warmup_start_factor: _Optional[float] = ..., decay_versions: _Optional[int] = ..., min_lr: _Optional[float] = ..., step_every: _Optional[int] = ..., gamma: _Optional[float] = ...) -> None: ...

class GetTopologyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Topology(_message.Message):
    __slots__ = ("shards", "shard_index", "job", "initialized", "model_digest", "specs", "version", "slice_elements", "tables", "replicas")
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    INITIALIZED_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    SPECS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SLICE_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedScalarFieldContainer[str]
    shard_index: int
    job: JobInfo
    initialized: bool
    model_digest: str
    specs: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    version: int
    slice_elements: int
    tables: _containers.RepeatedCompositeFieldContainer[TableSpec]
    replicas: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, shards: _Optional[_Iterable[str]] = ..., shard_index: _Optional[int] = ..., job: _Optional[_Union[JobInfo, _Mapping]] = ..., initialized: _Optional[bool] = ..., model_digest: _Optional[str] = ..., specs: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., version: _Optional[int] = ..., slice_elements: _Optional[int] = ..., tables: _Optional[_Iterable[_Union[TableSpec, _Mapping]]] = ..., replicas: _Optional[_Iterable[str]] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("worker_id", "job_name")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_NAME_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    job_name: str
    def __init__(self, worker_id: _Optional[str] = ..., job_name: _Optional[str] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("rank", "world_size", "version", "lease_timeout_s", "incarnation")
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LEASE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    rank: int
    world_size: int
    version: int
    lease_timeout_s: float
    incarnation: str
    def __init__(self, rank: _Optional[int] = ..., world_size: _Optional[int] = ..., version: _Optional[int] = ..., lease_timeout_s: _Optional[float] = ..., incarnation: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "idle")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    IDLE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    idle: bool
    def __init__(self, worker_id: _Optional[str] = ..., idle: _Optional[bool] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("worker_id", "finished")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    finished: bool
    def __init__(self, worker_id: _Optional[str] = ..., finished: _Optional[bool] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InitHeader(_message.Message):
    __slots__ = ("worker_id", "specs", "num_shards", "model_digest", "dtype", "tables")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SPECS_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    specs: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    num_shards: int
    model_digest: str
    dtype: DType
    tables: _containers.RepeatedCompositeFieldContainer[TableSpec]
    def __init__(self, worker_id: _Optional[str] = ..., specs: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., num_shards: _Optional[int] = ..., model_digest: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., tables: _Optional[_Iterable[_Union[TableSpec, _Mapping]]] = ...) -> None: ...

class InitMessage(_message.Message):
    __slots__ = ("header", "chunk", "rows")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    header: InitHeader
    chunk: Chunk
    rows: Rows
    def __init__(self, header: _Optional[_Union[InitHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., rows: _Optional[_Union[Rows, _Mapping]] = ...) -> None: ...

class InitResponse(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class ExportRowsRequest(_message.Message):
    __slots__ = ("model_digest", "table", "optimizer_state", "header_only")
    MODEL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STATE_FIELD_NUMBER: _ClassVar[int]
    HEADER_ONLY_FIELD_NUMBER: _ClassVar[int]
    model_digest: str
    table: int
    optimizer_state: bool
    header_only: bool
    def __init__(self, model_digest: _Optional[str] = ..., table: _Optional[int] = ..., optimizer_state: _Optional[bool] = ..., header_only: _Optional[bool] = ...) -> None: ...

class ExportRowsMessage(_message.Message):
    __slots__ = ("header", "rows")
    class Header(_message.Message):
        __slots__ = ("count", "dim", "state_cols", "version")
        COUNT_FIELD_NUMBER: _ClassVar[int]
        DIM_FIELD_NUMBER: _ClassVar[int]
        STATE_COLS_FIELD_NUMBER: _ClassVar[int]
        VERSION_FIELD_NUMBER: _ClassVar[int]
        count: int
        dim: int
        state_cols: int
        version: int
        def __init__(self, count: _Optional[int] = ..., dim: _Optional[int] = ..., state_cols: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...
    class Rows(_message.Message):
        __slots__ = ("count", "ids", "values", "state")
        COUNT_FIELD_NUMBER: _ClassVar[int]
        IDS_FIELD_NUMBER: _ClassVar[int]
        VALUES_FIELD_NUMBER: _ClassVar[int]
        STATE_FIELD_NUMBER: _ClassVar[int]
        count: int
        ids: bytes
        values: bytes
        state: bytes
        def __init__(self, count: _Optional[int] = ..., ids: _Optional[bytes] = ..., values: _Optional[bytes] = ..., state: _Optional[bytes] = ...) -> None: ...
    HEADER_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    header: ExportRowsMessage.Header
    rows: ExportRowsMessage.Rows
    def __init__(self, header: _Optional[_Union[ExportRowsMessage.Header, _Mapping]] = ..., rows: _Optional[_Union[ExportRowsMessage.Rows, _Mapping]] = ...) -> None: ...

class FollowRequest(_message.Message):
    __slots__ = ("model_digest", "since_version", "incarnation", "wait_ms", "full")
    MODEL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    SINCE_VERSION_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    FULL_FIELD_NUMBER: _ClassVar[int]
    model_digest: str
    since_version: int
    incarnation: str
    wait_ms: int
    full: bool
    def __init__(self, model_digest: _Optional[str] = ..., since_version: _Optional[int] = ..., incarnation: _Optional[str] = ..., wait_ms: _Optional[int] = ..., full: _Optional[bool] = ...) -> None: ...

class FollowMessage(_message.Message):
    __slots__ = ("header", "dense", "rows", "batch")
    class Header(_message.Message):
        __slots__ = ("version", "full", "incarnation", "model_digest", "dense_elements", "oldest_applied")
        VERSION_FIELD_NUMBER: _ClassVar[int]
        FULL_FIELD_NUMBER: _ClassVar[int]
        INCARNATION_FIELD_NUMBER: _ClassVar[int]
        MODEL_DIGEST_FIELD_NUMBER: _ClassVar[int]
        DENSE_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
        OLDEST_APPLIED_FIELD_NUMBER: _ClassVar[int]
        version: int
        full: bool
        incarnation: str
        model_digest: str
        dense_elements: int
        oldest_applied: float
        def __init__(self, version: _Optional[int] = ..., full: _Optional[bool] = ..., incarnation: _Optional[str] = ..., model_digest: _Optional[str] = ..., dense_elements: _Optional[int] = ..., oldest_applied: _Optional[float] = ...) -> None: ...
    class Dense(_message.Message):
        __slots__ = ("offset", "data")
        OFFSET_FIELD_NUMBER: _ClassVar[int]
        DATA_FIELD_NUMBER: _ClassVar[int]
        offset: int
        data: bytes
        def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...
    class Batch(_message.Message):
        __slots__ = ("rows",)
        ROWS_FIELD_NUMBER: _ClassVar[int]
        rows: _containers.RepeatedCompositeFieldContainer[Rows]
        def __init__(self, rows: _Optional[_Iterable[_Union[Rows, _Mapping]]] = ...) -> None: ...
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    header: FollowMessage.Header
    dense: FollowMessage.Dense
    rows: Rows
    batch: FollowMessage.Batch
    def __init__(self, header: _Optional[_Union[FollowMessage.Header, _Mapping]] = ..., dense: _Optional[_Union[FollowMessage.Dense, _Mapping]] = ..., rows: _Optional[_Union[Rows, _Mapping]] = ..., batch: _Optional[_Union[FollowMessage.Batch, _Mapping]] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("worker_id", "min_version", "dtype", "incarnation")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    min_version: int
    dtype: DType
    incarnation: str
    def __init__(self, worker_id: _Optional[str] = ..., min_version: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., incarnation: _Optional[str] = ...) -> None: ...

class PullHeader(_message.Message):
    __slots__ = ("version", "model_digest", "incarnation")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    version: int
    model_digest: str
    incarnation: str
    def __init__(self, version: _Optional[int] = ..., model_digest: _Optional[str] = ..., incarnation: _Optional[str] = ...) -> None: ...

class PullMessage(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PullHeader
    chunk: Chunk
    def __init__(self, header: _Optional[_Union[PullHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("worker_id", "step", "base_version", "model_digest", "dtype", "rows")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    step: int
    base_version: int
    model_digest: str
    dtype: DType
    rows: _containers.RepeatedCompositeFieldContainer[Rows]
    def __init__(self, worker_id: _Optional[str] = ..., step: _Optional[int] = ..., base_version: _Optional[int] = ..., model_digest: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., rows: _Optional[_Iterable[_Union[Rows, _Mapping]]] = ...) -> None: ...

class PushMessage(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    chunk: Chunk
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("version", "applied")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    version: int
    applied: bool
    def __init__(self, version: _Optional[int] = ..., applied: _Optional[bool] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("worker_id", "nonce", "elements", "model_digest", "shared_memory", "data_socket")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    DATA_SOCKET_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    nonce: bytes
    elements: int
    model_digest: str
    shared_memory: SharedMemory
    data_socket: DataSocket
    def __init__(self, worker_id: _Optional[str] = ..., nonce: _Optional[bytes] = ..., elements: _Optional[int] = ..., model_digest: _Optional[str] = ..., shared_memory: _Optional[_Union[SharedMemory, _Mapping]] = ..., data_socket: _Optional[_Union[DataSocket, _Mapping]] = ...) -> None: ...

class SharedMemory(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DataSocket(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AttachResponse(_message.Message):
    __slots__ = ("doorbell", "data_port")
    DOORBELL_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    doorbell: str
    data_port: int
    def __init__(self, doorbell: _Optional[str] = ..., data_port: _Optional[int] = ...) -> None: ...

class ExchangeRequest(_message.Message):
    __slots__ = ("worker_id", "model_digest", "push", "step", "base_version", "pull", "min_version", "incarnation", "inline", "dtype", "chunks", "rows", "lookup", "compression", "last_piece_first")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    INLINE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    LAST_PIECE_FIRST_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    model_digest: str
    push: bool
    step: int
    base_version: int
    pull: bool
    min_version: int
    incarnation: str
    inline: bool
    dtype: DType
    chunks: _containers.RepeatedCompositeFieldContainer[Chunk]
    rows: _containers.RepeatedCompositeFieldContainer[Rows]
    lookup: _containers.RepeatedCompositeFieldContainer[Rows]
    compression: Compression
    last_piece_first: bool
    def __init__(self, worker_id: _Optional[str] = ..., model_digest: _Optional[str] = ..., push: _Optional[bool] = ..., step: _Optional[int] = ..., base_version: _Optional[int] = ..., pull: _Optional[bool] = ..., min_version: _Optional[int] = ..., incarnation: _Optional[str] = ..., inline: _Optional[bool] = ..., dtype: _Optional[_Union[DType, str]] = ..., chunks: _Optional[_Iterable[_Union[Chunk, _Mapping]]] = ..., rows: _Optional[_Iterable[_Union[Rows, _Mapping]]] = ..., lookup: _Optional[_Iterable[_Union[Rows, _Mapping]]] = ..., compression: _Optional[_Union[Compression, _Mapping]] = ..., last_piece_first: _Optional[bool] = ...) -> None: ...

class Compression(_message.Message):
    __slots__ = ("kind", "count", "rank")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[Compression.Kind]
        TOP_K: _ClassVar[Compression.Kind]
        POWER_SGD: _ClassVar[Compression.Kind]
    KIND_UNSPECIFIED: Compression.Kind
    TOP_K: Compression.Kind
    POWER_SGD: Compression.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    kind: Compression.Kind
    count: int
    rank: int
    def __init__(self, kind: _Optional[_Union[Compression.Kind, str]] = ..., count: _Optional[int] = ..., rank: _Optional[int] = ...) -> None: ...

class ExchangeResponse(_message.Message):
    __slots__ = ("version", "applied", "pulled", "chunks", "rows", "rows_version")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    PULLED_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    ROWS_VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    applied: bool
    pulled: PullHeader
    chunks: _containers.RepeatedCompositeFieldContainer[Chunk]
    rows: _containers.RepeatedCompositeFieldContainer[Rows]
    rows_version: int
    def __init__(self, version: _Optional[int] = ..., applied: _Optional[bool] = ..., pulled: _Optional[_Union[PullHeader, _Mapping]] = ..., chunks: _Optional[_Iterable[_Union[Chunk, _Mapping]]] = ..., rows: _Optional[_Iterable[_Union[Rows, _Mapping]]] = ..., rows_version: _Optional[int] = ...) -> None: ...

class ClaimRequest(_message.Message):
    __slots__ = ("worker_id", "job_name", "dataset", "listed", "finish", "samples", "holding")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_NAME_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    LISTED_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    HOLDING_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    job_name: str
    dataset: str
    listed: int
    finish: int
    samples: int
    holding: int
    def __init__(self, worker_id: _Optional[str] = ..., job_name: _Optional[str] = ..., dataset: _Optional[str] = ..., listed: _Optional[int] = ..., finish: _Optional[int] = ..., samples: _Optional[int] = ..., holding: _Optional[int] = ...) -> None: ...

class ClaimResponse(_message.Message):
    __slots__ = ("shard", "version")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    shard: int
    version: int
    def __init__(self, shard: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class ClaimsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShardClaim(_message.Message):
    __slots__ = ("shard", "state", "worker_id", "tries", "samples")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TRIES_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    shard: int
    state: str
    worker_id: str
    tries: int
    samples: int
    def __init__(self, shard: _Optional[int] = ..., state: _Optional[str] = ..., worker_id: _Optional[str] = ..., tries: _Optional[int] = ..., samples: _Optional[int] = ...) -> None: ...

class ClaimsRecord(_message.Message):
    __slots__ = ("dataset", "claims")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    CLAIMS_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    claims: _containers.RepeatedCompositeFieldContainer[ShardClaim]
    def __init__(self, dataset: _Optional[str] = ..., claims: _Optional[_Iterable[_Union[ShardClaim, _Mapping]]] = ...) -> None: ...

class ServingIds(_message.Message):
    __slots__ = ("table", "ids")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: bytes
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[bytes] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("tables",)
    TABLES_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[ServingIds]
    def __init__(self, tables: _Optional[_Iterable[_Union[ServingIds, _Mapping]]] = ...) -> None: ...

class LookupReply(_message.Message):
    __slots__ = ("versions", "rows")
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedScalarFieldContainer[int]
    rows: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, versions: _Optional[_Iterable[int]] = ..., rows: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ServingPullRequest(_message.Message):
    __slots__ = ("shard",)
    SHARD_FIELD_NUMBER: _ClassVar[int]
    shard: int
    def __init__(self, shard: _Optional[int] = ...) -> None: ...

class ServingPullMessage(_message.Message):
    __slots__ = ("header", "dense")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    header: FollowMessage.Header
    dense: FollowMessage.Dense
    def __init__(self, header: _Optional[_Union[FollowMessage.Header, _Mapping]] = ..., dense: _Optional[_Union[FollowMessage.Dense, _Mapping]] = ...) -> None: ...

class ServingStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServingStatus(_message.Message):
    __slots__ = ("versions", "ready", "model_digest", "tables", "specs", "shards", "silent_seconds", "freshness_p50", "freshness_p99", "freshness_answers", "held", "lookup_port")
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    SPECS_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    SILENT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FRESHNESS_P50_FIELD_NUMBER: _ClassVar[int]
    FRESHNESS_P99_FIELD_NUMBER: _ClassVar[int]
    FRESHNESS_ANSWERS_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_PORT_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedScalarFieldContainer[int]
    ready: bool
    model_digest: str
    tables: _containers.RepeatedCompositeFieldContainer[TableSpec]
    specs: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    shards: int
    silent_seconds: _containers.RepeatedScalarFieldContainer[float]
    freshness_p50: float
    freshness_p99: float
    freshness_answers: int
    held: _containers.RepeatedScalarFieldContainer[int]
    lookup_port: int
    def __init__(self, versions: _Optional[_Iterable[int]] = ..., ready: _Optional[bool] = ..., model_digest: _Optional[str] = ..., tables: _Optional[_Iterable[_Union[TableSpec, _Mapping]]] = ..., specs: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., shards: _Optional[int] = ..., silent_seconds: _Optional[_Iterable[float]] = ..., freshness_p50: _Optional[float] = ..., freshness_p99: _Optional[float] = ..., freshness_answers: _Optional[int] = ..., held: _Optional[_Iterable[int]] = ..., lookup_port: _Optional[int] = ...) -> None: ...
