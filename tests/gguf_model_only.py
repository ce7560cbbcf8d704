"""A GGUF file as transformers' model reader needs it: without the
tokenizer's arrays. transformers' reader (gguf.GGUFReader) walks a string
array an element at a time, and reads the file twice (the config, then the
weights): ~50 s of a ~75 s load for Gemma 3's 262k-token vocabulary, of
which the model needs only the count (its `vocab_size`)."""

from __future__ import annotations

import struct
from pathlib import Path

DROPPED = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF scalar types' bytes
_UINT32, _STRING, _ARRAY = 4, 8, 9


def _string(data: bytes, at: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", data, at)
    return data[at + 8 : at + 8 + n].decode(), at + 8 + n


def _skip(data: bytes, at: int, kind: int) -> tuple[int, int]:
    """Past a value of type `kind` at `at`: (where it ends, its element count)."""
    if kind == _STRING:
        return _string(data, at)[1], 1
    if kind != _ARRAY:
        return at + _SIZES[kind], 1
    item, n = struct.unpack_from("<IQ", data, at)
    at += 12
    if item in _SIZES:
        return at + n * _SIZES[item], n
    for _ in range(n):
        at = _skip(data, at, item)[0]
    return at, n


def write(path: Path, into: Path) -> Path:
    """`path` less DROPPED, plus `{architecture}.vocab_size` where it is
    missing: the count transformers then takes from the vocabulary. The
    tensor table and the data are copied as they are (their offsets count
    from the data's aligned start)."""
    data = path.read_bytes()
    version, tensors, kvs = struct.unpack_from("<IQQ", data, 4)
    at, kept, keys, arch, align, vocab_size = 24, [], set(), "", 32, 0
    for _ in range(kvs):
        start = at
        key, at = _string(data, at)
        (kind,) = struct.unpack_from("<I", data, at)
        if key == "general.architecture":
            arch = _string(data, at + 4)[0]
        elif key == "general.alignment":
            (align,) = struct.unpack_from("<I", data, at + 4)
        at, count = _skip(data, at + 4, kind)
        if key == "tokenizer.ggml.tokens":
            vocab_size = count
        if key not in DROPPED:
            kept.append(data[start:at])
            keys.add(key)
    table = at
    for _ in range(tensors):
        at = _string(data, at)[1]
        (dims,) = struct.unpack_from("<I", data, at)
        at += 4 + 8 * dims + 4 + 8  # the dimensions, the encoding, the offset
    if f"{arch}.vocab_size" not in keys:
        key = f"{arch}.vocab_size".encode()
        kept.append(struct.pack("<Q", len(key)) + key + struct.pack("<II", _UINT32, vocab_size))
    head = b"GGUF" + struct.pack("<IQQ", version, tensors, len(kept)) + b"".join(kept) + data[table:at]
    with open(into, "wb") as out:
        out.write(head + bytes(-len(head) % align))
        out.write(memoryview(data)[-(-at // align) * align :])
    return into
