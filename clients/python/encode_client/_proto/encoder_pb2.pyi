from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Modality(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODALITY_IMAGE: _ClassVar[Modality]
    MODALITY_VIDEO: _ClassVar[Modality]
    MODALITY_AUDIO: _ClassVar[Modality]

class Return(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RETURN_EMBEDDINGS: _ClassVar[Return]
    RETURN_METADATA: _ClassVar[Return]
MODALITY_IMAGE: Modality
MODALITY_VIDEO: Modality
MODALITY_AUDIO: Modality
RETURN_EMBEDDINGS: Return
RETURN_METADATA: Return

class Item(_message.Message):
    __slots__ = ("hash", "data", "modality", "mm_processor_kwargs_json")
    HASH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    MODALITY_FIELD_NUMBER: _ClassVar[int]
    MM_PROCESSOR_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    hash: str
    data: bytes
    modality: Modality
    mm_processor_kwargs_json: str
    def __init__(self, hash: _Optional[str] = ..., data: _Optional[bytes] = ..., modality: _Optional[_Union[Modality, str]] = ..., mm_processor_kwargs_json: _Optional[str] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("items", "return_kind", "mm_processor_kwargs_json")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    RETURN_KIND_FIELD_NUMBER: _ClassVar[int]
    MM_PROCESSOR_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[Item]
    return_kind: Return
    mm_processor_kwargs_json: str
    def __init__(self, items: _Optional[_Iterable[_Union[Item, _Mapping]]] = ..., return_kind: _Optional[_Union[Return, str]] = ..., mm_processor_kwargs_json: _Optional[str] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class EncodeItem(_message.Message):
    __slots__ = ("index", "hash", "status", "source", "num_tokens", "embedding", "meta_json", "key")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    META_JSON_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    index: int
    hash: str
    status: str
    source: str
    num_tokens: int
    embedding: Tensor
    meta_json: str
    key: str
    def __init__(self, index: _Optional[int] = ..., hash: _Optional[str] = ..., status: _Optional[str] = ..., source: _Optional[str] = ..., num_tokens: _Optional[int] = ..., embedding: _Optional[_Union[Tensor, _Mapping]] = ..., meta_json: _Optional[str] = ..., key: _Optional[str] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("model", "fingerprint", "items")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    model: str
    fingerprint: str
    items: _containers.RepeatedCompositeFieldContainer[EncodeItem]
    def __init__(self, model: _Optional[str] = ..., fingerprint: _Optional[str] = ..., items: _Optional[_Iterable[_Union[EncodeItem, _Mapping]]] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("hashes", "modality", "mm_processor_kwargs_json")
    HASHES_FIELD_NUMBER: _ClassVar[int]
    MODALITY_FIELD_NUMBER: _ClassVar[int]
    MM_PROCESSOR_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[str]
    modality: Modality
    mm_processor_kwargs_json: str
    def __init__(self, hashes: _Optional[_Iterable[str]] = ..., modality: _Optional[_Union[Modality, str]] = ..., mm_processor_kwargs_json: _Optional[str] = ...) -> None: ...

class LookupItem(_message.Message):
    __slots__ = ("hash", "cached", "tier")
    HASH_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    hash: str
    cached: bool
    tier: str
    def __init__(self, hash: _Optional[str] = ..., cached: _Optional[bool] = ..., tier: _Optional[str] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[LookupItem]
    def __init__(self, items: _Optional[_Iterable[_Union[LookupItem, _Mapping]]] = ...) -> None: ...

class Size(_message.Message):
    __slots__ = ("width", "height")
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    width: int
    height: int
    def __init__(self, width: _Optional[int] = ..., height: _Optional[int] = ...) -> None: ...

class TokensRequest(_message.Message):
    __slots__ = ("items", "sizes", "mm_processor_kwargs_json")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    MM_PROCESSOR_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[Item]
    sizes: _containers.RepeatedCompositeFieldContainer[Size]
    mm_processor_kwargs_json: str
    def __init__(self, items: _Optional[_Iterable[_Union[Item, _Mapping]]] = ..., sizes: _Optional[_Iterable[_Union[Size, _Mapping]]] = ..., mm_processor_kwargs_json: _Optional[str] = ...) -> None: ...

class TokenCount(_message.Message):
    __slots__ = ("index", "num_tokens", "width", "height", "meta_json")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    META_JSON_FIELD_NUMBER: _ClassVar[int]
    index: int
    num_tokens: int
    width: int
    height: int
    meta_json: str
    def __init__(self, index: _Optional[int] = ..., num_tokens: _Optional[int] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., meta_json: _Optional[str] = ...) -> None: ...

class TokensResponse(_message.Message):
    __slots__ = ("model", "fingerprint", "items")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    model: str
    fingerprint: str
    items: _containers.RepeatedCompositeFieldContainer[TokenCount]
    def __init__(self, model: _Optional[str] = ..., fingerprint: _Optional[str] = ..., items: _Optional[_Iterable[_Union[TokenCount, _Mapping]]] = ...) -> None: ...

class ModelRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelResponse(_message.Message):
    __slots__ = ("id", "fingerprint", "kind", "dtype", "hidden_size", "json", "model")
    ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    JSON_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    id: str
    fingerprint: str
    kind: str
    dtype: str
    hidden_size: int
    json: str
    model: str
    def __init__(self, id: _Optional[str] = ..., fingerprint: _Optional[str] = ..., kind: _Optional[str] = ..., dtype: _Optional[str] = ..., hidden_size: _Optional[int] = ..., json: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...
