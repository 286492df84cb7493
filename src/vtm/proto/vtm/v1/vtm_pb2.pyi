from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HelloRequest(_message.Message):
    __slots__ = ("name", "priority", "guaranteed_bytes", "limit_bytes", "gives_back_ahead")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    GUARANTEED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    GIVES_BACK_AHEAD_FIELD_NUMBER: _ClassVar[int]
    name: str
    priority: int
    guaranteed_bytes: int
    limit_bytes: int
    gives_back_ahead: bool
    def __init__(self, name: _Optional[str] = ..., priority: _Optional[int] = ..., guaranteed_bytes: _Optional[int] = ..., limit_bytes: _Optional[int] = ..., gives_back_ahead: _Optional[bool] = ...) -> None: ...

class HelloReply(_message.Message):
    __slots__ = ("lease", "client_id", "backend", "device", "chunk_bytes", "capacity_bytes", "granularity", "fd_socket", "name", "step_socket", "priority", "guaranteed_bytes", "limit_bytes")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    GRANULARITY_FIELD_NUMBER: _ClassVar[int]
    FD_SOCKET_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STEP_SOCKET_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    GUARANTEED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    lease: str
    client_id: int
    backend: str
    device: int
    chunk_bytes: int
    capacity_bytes: int
    granularity: int
    fd_socket: str
    name: str
    step_socket: str
    priority: int
    guaranteed_bytes: int
    limit_bytes: int
    def __init__(self, lease: _Optional[str] = ..., client_id: _Optional[int] = ..., backend: _Optional[str] = ..., device: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., granularity: _Optional[int] = ..., fd_socket: _Optional[str] = ..., name: _Optional[str] = ..., step_socket: _Optional[str] = ..., priority: _Optional[int] = ..., guaranteed_bytes: _Optional[int] = ..., limit_bytes: _Optional[int] = ...) -> None: ...

class SetQuotaRequest(_message.Message):
    __slots__ = ("name", "limit_bytes", "guaranteed_bytes", "priority", "host_tier_limit_bytes", "reset")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    GUARANTEED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    name: str
    limit_bytes: int
    guaranteed_bytes: int
    priority: int
    host_tier_limit_bytes: int
    reset: bool
    def __init__(self, name: _Optional[str] = ..., limit_bytes: _Optional[int] = ..., guaranteed_bytes: _Optional[int] = ..., priority: _Optional[int] = ..., host_tier_limit_bytes: _Optional[int] = ..., reset: _Optional[bool] = ...) -> None: ...

class CreateSpaceRequest(_message.Message):
    __slots__ = ("row_bytes", "max_tokens", "max_slots", "namespace", "name", "window_tokens")
    ROW_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_SLOTS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    WINDOW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    row_bytes: int
    max_tokens: int
    max_slots: int
    namespace: str
    name: str
    window_tokens: int
    def __init__(self, row_bytes: _Optional[int] = ..., max_tokens: _Optional[int] = ..., max_slots: _Optional[int] = ..., namespace: _Optional[str] = ..., name: _Optional[str] = ..., window_tokens: _Optional[int] = ...) -> None: ...

class SpaceReply(_message.Message):
    __slots__ = ("space_id", "name", "namespace", "row_bytes", "max_tokens", "max_slots", "slot_bytes", "pages_per_slot", "window_tokens")
    SPACE_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ROW_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_SLOTS_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGES_PER_SLOT_FIELD_NUMBER: _ClassVar[int]
    WINDOW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    space_id: int
    name: str
    namespace: str
    row_bytes: int
    max_tokens: int
    max_slots: int
    slot_bytes: int
    pages_per_slot: int
    window_tokens: int
    def __init__(self, space_id: _Optional[int] = ..., name: _Optional[str] = ..., namespace: _Optional[str] = ..., row_bytes: _Optional[int] = ..., max_tokens: _Optional[int] = ..., max_slots: _Optional[int] = ..., slot_bytes: _Optional[int] = ..., pages_per_slot: _Optional[int] = ..., window_tokens: _Optional[int] = ...) -> None: ...

class SpaceRequest(_message.Message):
    __slots__ = ("space_id",)
    SPACE_ID_FIELD_NUMBER: _ClassVar[int]
    space_id: int
    def __init__(self, space_id: _Optional[int] = ...) -> None: ...

class CreateRequest(_message.Message):
    __slots__ = ("space_id", "num_tokens")
    SPACE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    space_id: int
    num_tokens: int
    def __init__(self, space_id: _Optional[int] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class ExtendRequest(_message.Message):
    __slots__ = ("vtensor_id", "num_tokens", "low")
    VTENSOR_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOW_FIELD_NUMBER: _ClassVar[int]
    vtensor_id: int
    num_tokens: int
    low: int
    def __init__(self, vtensor_id: _Optional[int] = ..., num_tokens: _Optional[int] = ..., low: _Optional[int] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("targets",)
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    targets: _containers.RepeatedCompositeFieldContainer[ExtendRequest]
    def __init__(self, targets: _Optional[_Iterable[_Union[ExtendRequest, _Mapping]]] = ...) -> None: ...

class ShrinkRequest(_message.Message):
    __slots__ = ("targets", "all_ahead")
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    ALL_AHEAD_FIELD_NUMBER: _ClassVar[int]
    targets: _containers.RepeatedCompositeFieldContainer[ShrinkTarget]
    all_ahead: bool
    def __init__(self, targets: _Optional[_Iterable[_Union[ShrinkTarget, _Mapping]]] = ..., all_ahead: _Optional[bool] = ...) -> None: ...

class ShrinkTarget(_message.Message):
    __slots__ = ("vtensor_id", "num_tokens")
    VTENSOR_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    vtensor_id: int
    num_tokens: int
    def __init__(self, vtensor_id: _Optional[int] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class VTensorRequest(_message.Message):
    __slots__ = ("vtensor_id",)
    VTENSOR_ID_FIELD_NUMBER: _ClassVar[int]
    vtensor_id: int
    def __init__(self, vtensor_id: _Optional[int] = ...) -> None: ...

class PrefixRecordRequest(_message.Message):
    __slots__ = ("space_id", "vtensor_id", "token_ids", "release")
    SPACE_ID_FIELD_NUMBER: _ClassVar[int]
    VTENSOR_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    space_id: int
    vtensor_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    release: bool
    def __init__(self, space_id: _Optional[int] = ..., vtensor_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., release: _Optional[bool] = ...) -> None: ...

class PrefixMatchRequest(_message.Message):
    __slots__ = ("space_id", "token_ids")
    SPACE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    space_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, space_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TrimRequest(_message.Message):
    __slots__ = ("all", "bytes")
    ALL_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    all: bool
    bytes: int
    def __init__(self, all: _Optional[bool] = ..., bytes: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PageEffect(_message.Message):
    __slots__ = ("slot", "page", "chunk", "serial")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    PAGE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    SERIAL_FIELD_NUMBER: _ClassVar[int]
    slot: int
    page: int
    chunk: int
    serial: int
    def __init__(self, slot: _Optional[int] = ..., page: _Optional[int] = ..., chunk: _Optional[int] = ..., serial: _Optional[int] = ...) -> None: ...

class SpaceEffects(_message.Message):
    __slots__ = ("space_id", "pages", "closed")
    SPACE_ID_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    space_id: int
    pages: _containers.RepeatedCompositeFieldContainer[PageEffect]
    closed: bool
    def __init__(self, space_id: _Optional[int] = ..., pages: _Optional[_Iterable[_Union[PageEffect, _Mapping]]] = ..., closed: _Optional[bool] = ...) -> None: ...

class VTensorState(_message.Message):
    __slots__ = ("vtensor_id", "space_id", "slot", "num_tokens", "released", "low")
    VTENSOR_ID_FIELD_NUMBER: _ClassVar[int]
    SPACE_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    LOW_FIELD_NUMBER: _ClassVar[int]
    vtensor_id: int
    space_id: int
    slot: int
    num_tokens: int
    released: bool
    low: int
    def __init__(self, vtensor_id: _Optional[int] = ..., space_id: _Optional[int] = ..., slot: _Optional[int] = ..., num_tokens: _Optional[int] = ..., released: _Optional[bool] = ..., low: _Optional[int] = ...) -> None: ...

class OpReply(_message.Message):
    __slots__ = ("effects", "vtensors", "value", "vtensor_id", "matched_tokens", "restored_tokens")
    EFFECTS_FIELD_NUMBER: _ClassVar[int]
    VTENSORS_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    VTENSOR_ID_FIELD_NUMBER: _ClassVar[int]
    MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESTORED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    effects: _containers.RepeatedCompositeFieldContainer[SpaceEffects]
    vtensors: _containers.RepeatedCompositeFieldContainer[VTensorState]
    value: int
    vtensor_id: int
    matched_tokens: int
    restored_tokens: int
    def __init__(self, effects: _Optional[_Iterable[_Union[SpaceEffects, _Mapping]]] = ..., vtensors: _Optional[_Iterable[_Union[VTensorState, _Mapping]]] = ..., value: _Optional[int] = ..., vtensor_id: _Optional[int] = ..., matched_tokens: _Optional[int] = ..., restored_tokens: _Optional[int] = ...) -> None: ...

class PrefixNode(_message.Message):
    __slots__ = ("start", "end", "tokens", "locks", "pages", "on_host", "host_pages")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOCKS_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    ON_HOST_FIELD_NUMBER: _ClassVar[int]
    HOST_PAGES_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    locks: int
    pages: _containers.RepeatedScalarFieldContainer[int]
    on_host: bool
    host_pages: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., locks: _Optional[int] = ..., pages: _Optional[_Iterable[int]] = ..., on_host: _Optional[bool] = ..., host_pages: _Optional[_Iterable[bool]] = ...) -> None: ...

class PrefixNodesReply(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[PrefixNode]
    def __init__(self, nodes: _Optional[_Iterable[_Union[PrefixNode, _Mapping]]] = ...) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("json",)
    JSON_FIELD_NUMBER: _ClassVar[int]
    json: str
    def __init__(self, json: _Optional[str] = ...) -> None: ...
