"""GGUF files: the header (metadata and tensor table), and the tensors as
MLX arrays in the two forms worker/model.py loads: float arrays, or MLX's
affine quantized triplets (`name.weight` packed uint32, `name.scales`,
`name.biases`, `GROUP_SIZE` weights a scale, or 16 for `SIXTEENS` and
three `CODEBOOKS`). A tensor without biases is one of kvmux_native's
other modes (`mode`): iq4_nl for `NONLINEAR`, symmetric for Q6_K, Q3_K
and `CODEBOOKS`.

Q4_0, Q4_1 and Q8_0 blocks already are that affine code (`w = scale * q +
bias` per 32 weights): they become triplets losslessly, as MLX's own GGUF
reader makes them. When every tensor is float or one of those, mx.load
reads the file whole (the embedded model's path, the fastest). Any other
encoding (the K-quants, Q5_0, Q5_1, the IQ codes) makes mx.load fail, so
such a file is read tensor by tensor: those three still become triplets
here, and so do Q5_0 and Q5_1 (5-bit codes, a scale and a minimum per 32
weights: MLX's 5-bit layout), Q4_K and Q5_K (a scale and a minimum per 32
weights: with float32 scales `d * sc` and biases `-dmin * m` their weights
are exactly the gguf package's). Where kvmux_native's kernel runs
(`kernel`) three more kinds stay quantized, exactly too: Q6_K, Q3_K and Q2_K,
which have a scale per 16 weights, as 16-weight groups with float32
scales (`_sixteens`: MLX's layout takes no groups of 16, the kernel does;
Q6_K's and Q3_K's codes centred, no biases), and IQ4_NL and IQ4_XS, whose
4-bit codes index a table of 16 int8 values, as those codes and their
scales without biases (`_nonlinear`: the kernel's mode iq4_nl looks the
values up), and the i-quants below 4 bits whose weight is a scale times
a small integer (`CODEBOOKS`: a grid's value and a sign, or IQ1's value
plus a delta of 1/8, times 8), as those integers, centred codes of 8 or 5
bits, and float32 scales (`_codebook`). The rest (the ternary and FP4
encodings) are dequantized to float32 by the gguf package (llama.cpp's
gguf-py: the values llama.cpp computes with). Where weights stay quantized on a GPU
(`requantize`) every encoding but the affine five, the K-quants included,
is quantized again by mx.quantize, at the narrowest MLX width holding the
encoding's (Q4_K: 4 bits, Q6_K: 6): MLX's GPU kernels take no float32
scales and no K-quant code of their own.

The header is parsed here, not by gguf.GGUFReader, which makes a numpy view
per element of the tokenizer's arrays: 12 s for Gemma 3's 262k-token
vocabulary, 0.05 s skipping them (the tokenizer is transformers' business).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import Q4_K, dequantize

GROUP_SIZE = 32
FLOATS = {Q.F32: np.float32, Q.F16: np.float16, Q.BF16: np.uint16}  # BF16 read as its bits
AFFINE = {Q.Q4_0, Q.Q4_1, Q.Q8_0}  # what mx.load reads
EXACT = AFFINE | {Q.Q5_0, Q.Q5_1}  # MLX's layout with float16 scales, as they are
K_QUANTS = {Q.Q4_K, Q.Q5_K}  # MLX's layout with float32 scales (not on a GPU)
SIXTEENS = {Q.Q6_K: 6, Q.Q3_K: 3, Q.Q2_K: 2}  # 16-weight groups, float32 scales: kvmux_native's kernel only
NONLINEAR = {Q.IQ4_NL, Q.IQ4_XS}  # 4-bit codes of a table's values, no biases: kvmux_native's kernel only
# A scale (per 32 weights; IQ2_XS's, IQ2_S's and IQ1_M's per 16) times a
# small integer: symmetric codes of these bits, no biases: kvmux_native's
# kernel only.
CODEBOOKS = {Q.IQ2_XXS: 8, Q.IQ2_XS: 8, Q.IQ2_S: 8, Q.IQ3_XXS: 8, Q.IQ3_S: 5, Q.IQ1_S: 5, Q.IQ1_M: 5}
MLX_BITS = (2, 3, 4, 5, 6, 8)

# GGUF metadata value types: struct codes of the scalars, and numpy types of
# the arrays kept (string arrays, the vocabulary, are skipped).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass
class Tensor:
    name: str
    encoding: Q
    shape: tuple[int, ...]  # numpy's order (the file lists the innermost dimension first)
    offset: int  # of its data, in the file


@dataclass
class Header:
    meta: dict[str, object]  # string arrays (the tokenizer's vocabulary) are None
    tensors: list[Tensor]

    @property
    def encodings(self) -> set[Q]:
        return {t.encoding for t in self.tensors}


class _Cursor:
    def __init__(self, data: memoryview):
        self.data, self.at = data, 0

    def scalar(self, code: str):
        (value,) = struct.unpack_from("<" + code, self.data, self.at)
        self.at += struct.calcsize(code)
        return value

    def string(self) -> str:
        n = self.scalar("Q")
        self.at += n
        return bytes(self.data[self.at - n : self.at]).decode("utf-8", "replace")

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            return self.scalar(_SCALARS[kind])
        item, n = self.scalar("I"), self.scalar("Q")
        if item == _STRING:
            for _ in range(n):
                self.at += 8 + struct.unpack_from("<Q", self.data, self.at)[0]
            return None
        if item in _SCALARS:
            values = np.frombuffer(self.data, "<" + _SCALARS[item], n, self.at)
            self.at += values.nbytes
            return values
        return [self.value(item) for _ in range(n)]


def read_header(path: Path) -> Header:
    data = np.memmap(path, mode="r")
    cursor = _Cursor(memoryview(data))
    if bytes(data[:4]) != b"GGUF":
        raise ValueError("not a GGUF file")
    cursor.at = 4
    version = cursor.scalar("I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 and 3, little-endian)")
    count, kv_count = cursor.scalar("Q"), cursor.scalar("Q")
    meta = {}
    for _ in range(kv_count):
        key = cursor.string()
        meta[key] = cursor.value(cursor.scalar("I"))
    table = []
    for _ in range(count):
        name = cursor.string()
        dims = [cursor.scalar("Q") for _ in range(cursor.scalar("I"))]
        kind, offset = cursor.scalar("I"), cursor.scalar("Q")
        try:
            encoding = Q(kind)
        except ValueError:
            raise ValueError(f"tensor {name} has an encoding unknown to the gguf package ({kind})") from None
        table.append((name, encoding, tuple(reversed(dims)), offset))
    align = meta.get("general.alignment", 32)
    start = -(-cursor.at // align) * align
    return Header(meta, [Tensor(name, enc, shape, start + offset) for name, enc, shape, offset in table])


def read_tensors(path: Path, header: Header, requantize: bool, kernel: bool = False) -> dict[str, mx.array]:
    """Every tensor: floats as stored, triplets for the affine encodings
    (Q4_K and Q5_K too, unless `requantize`; SIXTEENS, NONLINEAR and
    CODEBOOKS where kvmux_native's kernel multiplies them, `kernel`), the
    rest float32 (or quantized again, `requantize`)."""
    check(header)
    if header.encodings <= FLOATS.keys() | AFFINE:
        return mx.load(str(path))
    data = np.memmap(path, mode="r")
    weights = {}
    for tensor in header.tensors:
        block, size = GGML_QUANT_SIZES[tensor.encoding]
        rows, cols = int(np.prod(tensor.shape[:-1])), tensor.shape[-1]
        raw = np.frombuffer(data, np.uint8, rows * cols // block * size, tensor.offset).reshape(rows, -1)
        prefix = tensor.name.removesuffix(".weight")
        if tensor.encoding in FLOATS:
            array = mx.array(raw.view(FLOATS[tensor.encoding]).reshape(tensor.shape))
            weights[tensor.name] = array.view(mx.bfloat16) if tensor.encoding == Q.BF16 else array
        elif as_stored(tensor.encoding, requantize, kernel):
            triplet = _affine(raw.reshape(rows, cols // block, size), tensor.encoding)
            for part, array in zip(("weight", "scales", "biases"), triplet, strict=True):
                if array is not None:  # the biases of a mode without them (`mode`)
                    weights[f"{prefix}.{part}"] = mx.array(array.reshape(*tensor.shape[:-1], -1))
        else:
            values = mx.array(dequantize(raw, tensor.encoding).reshape(tensor.shape))
            if requantize:
                bits = next(b for b in MLX_BITS if b >= min(8, size * 8 // block))
                weight, scales, biases = mx.quantize(values, group_size=GROUP_SIZE, bits=bits)
                weights[f"{prefix}.weight"] = weight
                weights[f"{prefix}.scales"], weights[f"{prefix}.biases"] = (
                    scales.astype(mx.float16),
                    biases.astype(mx.float16),
                )
            else:
                weights[tensor.name] = values
    return weights


def as_stored(encoding: Q, requantize: bool, kernel: bool) -> bool:
    """Whether read_tensors keeps a quantized encoding's tensors as the file
    stores them (MLX triplets), for a GPU (`requantize`) or where
    kvmux_native's kernel runs (`kernel`)."""
    return (
        encoding in EXACT
        or (encoding in K_QUANTS and not requantize)
        or (encoding in SIXTEENS.keys() | NONLINEAR | CODEBOOKS.keys() and kernel)
    )


def mode(bits: int, biases: bool) -> str:
    """The kvmux_native mode of a quantized tensor read_tensors made: affine
    with biases (worker/model.py's `_mode` finds the symmetric ones among
    them: Q4_0, Q5_0, Q8_0); without, iq4_nl at 4 bits (NONLINEAR),
    symmetric at 3, 5, 6 and 8 (Q3_K, Q6_K and CODEBOOKS)."""
    if biases:
        return "affine"
    return "iq4_nl" if bits == 4 else "symmetric"


def check(header: Header) -> None:
    """Refuse a file holding tensors in an encoding that cannot load."""
    refused = {e for e in header.encodings if not decodable(e)}
    if refused:
        tensors = [f"{t.name} ({t.encoding.name})" for t in header.tensors if t.encoding in refused]
        more = f" and {len(tensors) - 3} more" if len(tensors) > 3 else ""
        raise ValueError(
            f"tensor encodings {', '.join(sorted(e.name for e in refused))} are neither MLX's nor decoded by the"
            f" gguf package: {', '.join(tensors[:3])}{more} (llama.cpp's llama-quantize can re-encode the file,"
            " e.g. as Q4_K_M or Q8_0)"
        )


def decodable(encoding: Q) -> bool:
    """Whether tensors in `encoding` load: MLX reads them, or the gguf
    package decodes them (tried on one block of zeros)."""
    if encoding in FLOATS or encoding in AFFINE:
        return True
    try:
        dequantize(np.zeros((1, GGML_QUANT_SIZES[encoding][1]), np.uint8), encoding)
    except NotImplementedError:
        return False
    return True


def _affine(blocks: np.ndarray, encoding: Q) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(rows, blocks, bytes) of Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, a K-quant, an
    IQ4 or a CODEBOOKS i-quant as MLX's packed weights, scales and biases
    (what mx.load makes of the first three; none, None, where `mode` says
    so)."""
    if encoding in CODEBOOKS:
        return _codebook(blocks, encoding)
    if encoding in K_QUANTS:
        return _k_quant(blocks, encoding)
    if encoding in SIXTEENS:
        return _sixteens(blocks, encoding)
    if encoding in NONLINEAR:
        return _nonlinear(blocks, encoding)
    scale = blocks[..., :2].copy().view(np.float16)[..., 0]
    if encoding == Q.Q8_0:  # int8 q: w = d * q = d * (q + 128) - 128 d
        return (blocks[..., 2:] ^ np.uint8(0x80)).reshape(len(blocks), -1).view(np.uint32), scale, scale * -128
    if encoding in (Q.Q4_1, Q.Q5_1):  # w = d * q + m
        bias, codes = blocks[..., 2:4].copy().view(np.float16)[..., 0], blocks[..., 4:]
    else:  # Q4_0 and Q5_0: w = d * (q - 8) and d * (q - 16)
        bias, codes = scale * (-8 if encoding == Q.Q4_0 else -16), blocks[..., 2:]
    if encoding in (Q.Q5_0, Q.Q5_1):  # each weight's fifth bit first, as a little-endian uint32
        fifth = (codes[..., :4].copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1
        return _packed(_nibbles(codes[..., 4:]) | (fifth.astype(np.uint8) << 4), 5), scale, bias
    return _packed(_nibbles(codes), 4), scale, bias


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """A 32-weight block's 16 bytes: weights 0-15 in their low nibbles, 16-31
    in their high ones (Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS)."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1)


def _packed(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes (rows, ...: a multiple of 8 a row) packed as MLX packs
    `bits`-bit codes, a little-endian bit stream (at 4 bits, weights 2i
    and 2i + 1 in byte i): rows of uint32."""
    rows = len(codes)
    codes = codes.reshape(rows, -1)
    if bits == 4:
        return (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(np.uint32)
    eights = codes.shape[1] // 8
    out = np.empty((rows, eights, bits), np.uint8)
    shifts = np.arange(8, dtype=np.uint64) * np.uint64(bits)
    for at in range(0, rows, 1024):  # 8 codes a uint64, 1,024 rows at a time (a bounded copy)
        eight = codes[at : at + 1024].reshape(-1, eights, 8).astype(np.uint64)
        words = np.bitwise_or.reduce(eight << shifts, axis=-1)
        out[at : at + 1024] = words.view(np.uint8).reshape(-1, eights, 8)[..., :bits]
    return out.reshape(rows, -1).view(np.uint32)


def _k_quant(blocks: np.ndarray, encoding: Q) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K or Q5_K super-blocks (256 weights: d, dmin, 8 packed 6-bit
    scales and minimums, Q5_K's fifth bits, 4-bit codes) as 32-weight
    groups with float32 scales `d * sc` and biases `-dmin * m`: exact (d * sc
    has 17 significant bits, times a 5-bit code 22), so `q * scale + bias`
    is gguf-py's `d * sc * q - dmin * m`."""
    rows = len(blocks)
    flat = blocks.reshape(-1, blocks.shape[-1])
    d = flat[:, :2].copy().view(np.float16).astype(np.float32)
    dmin = flat[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(flat[:, 4 : 4 + Q4_K.K_SCALE_SIZE])
    scales, biases = d * sc.astype(np.float32), -(dmin * m.astype(np.float32))
    rest = flat[:, 4 + Q4_K.K_SCALE_SIZE :]
    fifth = None
    if encoding == Q.Q5_K:  # 32 bytes: bit j of byte l is weight 32j + l's fifth bit
        fifth, rest = rest[:, :32], rest[:, 32:]
    # Each 64 weights: 32 bytes, weights 0-31 in their low nibbles, 32-63 in their high ones.
    qs = rest.reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    codes = (qs & np.uint8(0x0F)).reshape(-1, 8, 32)
    if fifth is not None:
        codes |= ((fifth.reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1) << 4
    bits = 5 if encoding == Q.Q5_K else 4
    return _packed(codes.reshape(rows, -1), bits), scales.reshape(rows, -1), biases.reshape(rows, -1)


def _sixteens(blocks: np.ndarray, encoding: Q) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Q6_K, Q3_K or Q2_K super-blocks (256 weights, a scale per 16) as
    16-weight groups of unsigned codes with float32 scales and biases, in
    the gguf package's order and values. A scale (`d * sc`: d a float16,
    sc an int8 at most) times a code has at most 24 significant bits, all
    float32 holds, so `q * scale + bias` rounds once, as gguf-py's
    `d * sc * (q - 32)` (Q6_K), `d * sc * (q - 4)` (Q3_K: both exact, the
    bias -2^(bits - 1) times the scale: kvmux_native's symmetric mode,
    none stored) and `d * sc * q - dmin * m` (Q2_K) do."""
    rows = len(blocks)
    flat = blocks.reshape(-1, blocks.shape[-1])
    if encoding == Q.Q6_K:  # 128 bytes of low nibbles, 64 of high 2 bits, 16 int8 scales, d
        ql = flat[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        qh = flat[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
        codes = (ql & np.uint8(0x0F)).reshape(-1, 256) | ((qh & np.uint8(3)) << np.uint8(4)).reshape(-1, 256)
        d = flat[:, 208:210].copy().view(np.float16).astype(np.float32)
        scales = d * flat[:, 192:208].view(np.int8).astype(np.float32)
        biases = None  # -32 * scale: symmetric
    elif encoding == Q.Q3_K:  # 32 bytes of high bits, 64 of low 2 bits, 12 of 6-bit scales, d
        low = flat[:, 32:96].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
        high = flat[:, :32].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        codes = (low & np.uint8(3)).reshape(-1, 256) | ((high & np.uint8(1)) << np.uint8(2)).reshape(-1, 256)
        packed = flat[:, 96:108]
        lows = (packed[:, :8].reshape(-1, 1, 8) >> np.array([0, 4], np.uint8).reshape(1, 2, 1)).reshape(-1, 16)
        highs = (packed[:, 8:].reshape(-1, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 4, 1)).reshape(-1, 16)
        sc = ((lows & np.uint8(0x0F)) | ((highs & np.uint8(3)) << np.uint8(4))).astype(np.float32) - 32
        d = flat[:, 108:110].copy().view(np.float16).astype(np.float32)
        scales = d * sc  # a weight is scale * (q - 4), q the 3 bits (the high bit set: no offset)
        biases = None  # -4 * scale: symmetric
    else:  # Q2_K: 16 bytes of 4-bit scales and minimums, 64 of 2-bit codes, d, dmin
        codes = (flat[:, 16:80].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
        d = flat[:, 80:82].copy().view(np.float16).astype(np.float32)
        dmin = flat[:, 82:84].copy().view(np.float16).astype(np.float32)
        scales = d * (flat[:, :16] & np.uint8(0x0F)).astype(np.float32)
        biases = -(dmin * (flat[:, :16] >> np.uint8(4)).astype(np.float32)).reshape(rows, -1)
    return _packed(codes.reshape(rows, -1), SIXTEENS[encoding]), scales.reshape(rows, -1), biases


def _nonlinear(blocks: np.ndarray, encoding: Q) -> tuple[np.ndarray, np.ndarray, None]:
    """IQ4_NL blocks (32 weights: d, 16 bytes of 4-bit indices, laid out as
    Q4_0's) or IQ4_XS super-blocks (256 weights: d, 6-bit scales per 32,
    the same indices) as MLX's 4-bit codes of the indices, scale d (IQ4_XS:
    `d * (ls - 32)`, float32) and no biases: kvmux_native's iq4_nl mode
    computes `IQ4_NL.kvalues[q] * scale`, exact (the scale has at most 16
    significant bits, a value 8), gguf-py's value, at the file's bits a
    code."""
    rows = len(blocks)
    flat = blocks.reshape(-1, blocks.shape[-1])
    d = flat[:, :2].copy().view(np.float16)
    if encoding == Q.IQ4_NL:
        indices, scales = _nibbles(flat[:, 2:]), d[:, 0]
    else:  # d, 2 bytes of scales' high 2 bits, 4 of their low 4, then 8 x 16 bytes of indices
        high = (flat[:, 2:4].copy().view(np.uint16) >> np.arange(0, 16, 2, dtype=np.uint16)) & 3
        low = (flat[:, 4:8].reshape(-1, 4, 1) >> np.array([0, 4], np.uint8).reshape(1, 1, 2)).reshape(-1, 8) & 0x0F
        ls = (low | (high.astype(np.uint8) << 4)).astype(np.float32) - 32
        indices = _nibbles(flat[:, 8:].reshape(-1, 8, 16))
        scales = d.astype(np.float32) * ls
    return _packed(indices.reshape(rows, -1), 4), scales.reshape(rows, -1), None


def _codebook(blocks: np.ndarray, encoding: Q) -> tuple[np.ndarray, np.ndarray, None]:
    """A CODEBOOKS encoding's super-blocks (256 weights) as symmetric codes
    of its bits, float32 scales and no biases: each weight gguf-py decodes
    divided by its group's scale (`_codebook_scales`) is an integer (a
    grid's value and a sign, or 8 times IQ1's value plus its delta), so
    `(q - 2^(bits - 1)) * scale` is that weight, one rounding of the same
    product. Decoded 256 rows at a time (a bounded float32 copy)."""
    rows, count, size = blocks.shape
    bits = CODEBOOKS[encoding]
    scales = _codebook_scales(blocks.reshape(-1, size), encoding).reshape(rows, -1)
    codes = np.empty((rows, count * 256), np.uint8)
    for at in range(0, rows, 256):
        s = scales[at : at + 256, :, None]
        values = dequantize(blocks[at : at + 256].reshape(len(s), -1), encoding).reshape(*s.shape[:2], -1)
        q = np.divide(values, s, out=np.zeros_like(values), where=s != 0)  # a zero scale's weights: 0
        codes[at : at + 256] = (np.nan_to_num(np.rint(q)) + 2 ** (bits - 1)).astype(np.uint8).reshape(len(s), -1)
    return _packed(codes, bits), scales, None


def _codebook_scales(flat: np.ndarray, encoding: Q) -> np.ndarray:
    """(blocks, bytes) of a CODEBOOKS encoding: each group's scale (float32,
    (blocks, groups)) as gguf-py computes it, IQ1's over 8 (exact)."""
    if encoding == Q.IQ1_M:  # d's 16 bits in the top nibbles of its last 4 uint16s, 3-bit scales per 16 below
        words = flat[:, 48:56].copy().view(np.uint16)
        d = np.bitwise_or.reduce((words >> 12) << np.array([0, 4, 8, 12], np.uint16), axis=-1).astype(np.uint16)
        scales = ((words[..., None] >> np.array([0, 3, 6, 9], np.uint16)) & 7).reshape(len(flat), -1)
        return d.view(np.float16).astype(np.float32)[:, None] * (2 * scales + 1) * np.float32(0.125)
    d = flat[:, :2].copy().view(np.float16).astype(np.float32)
    if encoding == Q.IQ2_XXS:  # 8 x (4 grid indices, a uint32 of signs with a 4-bit scale on top)
        ls = (flat[:, 2:].copy().view(np.uint32)[:, 1::2] >> 28).astype(np.float32)
        return d * (np.float32(0.5) + ls) * np.float32(0.25)
    if encoding == Q.IQ3_XXS:  # 64 grid indices, then 8 uint32s as IQ2_XXS's second
        ls = (flat[:, 66:].copy().view(np.uint32) >> 28).astype(np.float32)
        return d * (np.float32(0.5) + ls) * np.float32(0.5)
    if encoding in (Q.IQ2_XS, Q.IQ2_S):  # the last 8 bytes: a 4-bit scale per 16 weights
        ls = ((flat[:, -8:, None] >> np.array([0, 4], np.uint8)) & 15).reshape(len(flat), -1)
        return d * (np.float32(0.5) + ls.astype(np.float32)) * np.float32(0.25)
    if encoding == Q.IQ3_S:  # the last 4 bytes: a 4-bit scale per 32 weights
        ls = (flat[:, -4:, None] >> np.array([0, 4], np.uint8)) & 15
        return d * (1 + 2 * ls.reshape(len(flat), -1))
    qh = flat[:, 34:].copy().view(np.uint16)  # IQ1_S: 32 grid indices' low bytes, then a uint16 per 32 weights
    return d * (2 * ((qh >> 12) & 7) + 1) * np.float32(0.125)
