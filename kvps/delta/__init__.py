"""The binary frame format and the lossless array codecs (pure core: no I/O)."""
from kvps.delta.codec import compress, decompress, shuffle, unshuffle
from kvps.delta.frame import (
    DEFAULT_MAX_RAW_BYTES,
    KIND_COMMAND,
    KIND_REQUEST,
    KIND_RESPONSE,
    KIND_SNAPSHOT,
    Bf16,
    Frame,
    decode,
    encode,
    encode_parts,
)

__all__ = [
    "Bf16",
    "DEFAULT_MAX_RAW_BYTES",
    "Frame",
    "KIND_COMMAND",
    "KIND_REQUEST",
    "KIND_RESPONSE",
    "KIND_SNAPSHOT",
    "compress",
    "decode",
    "decompress",
    "encode",
    "encode_parts",
    "shuffle",
    "unshuffle",
]
