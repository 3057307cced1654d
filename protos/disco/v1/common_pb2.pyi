from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    def __init__(self, max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class Distribution(_message.Message):
    __slots__ = ("vocab_size", "dense_f32", "sparse")
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    DENSE_F32_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    vocab_size: int
    dense_f32: bytes
    sparse: SparseDistribution
    def __init__(self, vocab_size: _Optional[int] = ..., dense_f32: _Optional[bytes] = ..., sparse: _Optional[_Union[SparseDistribution, _Mapping]] = ...) -> None: ...

class SparseDistribution(_message.Message):
    __slots__ = ("ids_u32", "probs_f32")
    IDS_U32_FIELD_NUMBER: _ClassVar[int]
    PROBS_F32_FIELD_NUMBER: _ClassVar[int]
    ids_u32: bytes
    probs_f32: bytes
    def __init__(self, ids_u32: _Optional[bytes] = ..., probs_f32: _Optional[bytes] = ...) -> None: ...

class Feedback(_message.Message):
    __slots__ = ("num_accepted", "bonus_token_id")
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    BONUS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    num_accepted: int
    bonus_token_id: int
    def __init__(self, num_accepted: _Optional[int] = ..., bonus_token_id: _Optional[int] = ...) -> None: ...

class StartSessionResponse(_message.Message):
    __slots__ = ("prompt_tokens", "elapsed_ns")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_NS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    elapsed_ns: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., elapsed_ns: _Optional[int] = ...) -> None: ...

class EndSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class EndSessionResponse(_message.Message):
    __slots__ = ("elapsed_ns",)
    ELAPSED_NS_FIELD_NUMBER: _ClassVar[int]
    elapsed_ns: int
    def __init__(self, elapsed_ns: _Optional[int] = ...) -> None: ...

class ServiceInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServiceInfo(_message.Message):
    __slots__ = ("role", "model_name", "fingerprint", "tokenizer_hash", "vocab_size", "max_context", "eos_token_ids", "dtype", "device", "active_sessions", "max_sessions", "idle_ttl_s", "version", "elapsed_ns", "forward_s", "overlap", "batching", "live_forward_s", "exactness", "kernel", "security")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_HASH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    IDLE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_NS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_FIELD_NUMBER: _ClassVar[int]
    BATCHING_FIELD_NUMBER: _ClassVar[int]
    LIVE_FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    EXACTNESS_FIELD_NUMBER: _ClassVar[int]
    KERNEL_FIELD_NUMBER: _ClassVar[int]
    SECURITY_FIELD_NUMBER: _ClassVar[int]
    role: str
    model_name: str
    fingerprint: str
    tokenizer_hash: str
    vocab_size: int
    max_context: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    device: str
    active_sessions: int
    max_sessions: int
    idle_ttl_s: float
    version: str
    elapsed_ns: int
    forward_s: _containers.RepeatedScalarFieldContainer[float]
    overlap: bool
    batching: str
    live_forward_s: _containers.RepeatedScalarFieldContainer[float]
    exactness: str
    kernel: str
    security: str
    def __init__(self, role: _Optional[str] = ..., model_name: _Optional[str] = ..., fingerprint: _Optional[str] = ..., tokenizer_hash: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., active_sessions: _Optional[int] = ..., max_sessions: _Optional[int] = ..., idle_ttl_s: _Optional[float] = ..., version: _Optional[str] = ..., elapsed_ns: _Optional[int] = ..., forward_s: _Optional[_Iterable[float]] = ..., overlap: _Optional[bool] = ..., batching: _Optional[str] = ..., live_forward_s: _Optional[_Iterable[float]] = ..., exactness: _Optional[str] = ..., kernel: _Optional[str] = ..., security: _Optional[str] = ...) -> None: ...
