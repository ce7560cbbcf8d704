"""kvmux's native CPU ops (worker/native) in this process, on random and
real weights: the quantized matmul against MLX's own dequantize + matmul
for every width and group size (groups of 16 too, which MLX has not,
IQ4_NL's table of 4-bit levels and centred codes), a row's bits whatever else the product
holds and whichever instruction set runs it, the fused norm and rope
against mx.fast's, a layer's fused halves against the separate ops, the
sampler against mlx-lm's chain and its draws against its distribution,
the int8 products against their arithmetic in float64 and against the
exact products, bad arguments refused by name, and the whole model's
logits against float32 copies of the same weights."""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np
import pytest
from gguf.quants import IQ4_NL

native = pytest.importorskip("kvmux_native", reason="make setup builds worker/native")

ROWS = (1, 2, 3, 8, 17, 64, 300)
# The kernel sums in another order than BLAS: a product's error against
# float32 BLAS on the same dequantized weights, relative to its largest
# value, is this small (float32's epsilon is 1.2e-7).
TOLERANCE = 2e-6


def quantized(n: int, k: int, bits: int, group: int, seed: int, scales=mx.float16, mode="affine"):
    """Random weights in MLX's affine layout, scales and biases as GGUF files
    keep them; groups of 16 (which mx.quantize does not make) with float32
    scales, as worker/gguf_file.py keeps Q6_K, Q3_K and Q2_K; iq4_nl and
    symmetric: codes with scales and no biases (None), as it keeps IQ4_NL and
    IQ4_XS, and worker/model.py Q6_K, Q3_K, Q4_0, Q5_0 and Q8_0."""
    w = mx.random.normal((n, k), key=mx.random.key(seed))
    codes, s, b = mx.quantize(w, group_size=max(group, 32), bits=bits)
    if mode != "affine":
        s = mx.random.uniform(-0.02, 0.02, (n, k // group), key=mx.random.key(seed + 1))
        return codes, s.astype(scales), None
    if group == 16:
        s = mx.random.uniform(0.01, 0.1, (n, k // 16), key=mx.random.key(seed + 1))
        return codes, s, -mx.random.uniform(0, 2, (n, k // 16), key=mx.random.key(seed + 2)) * s
    return codes, s.astype(scales), b.astype(scales)


def reference(x, codes, s, b, group, bits, mode="affine"):
    """float32 copies of the weights (the worker's fallback), times x."""
    if mode != "affine":  # each code's level, or the code less 2^(bits - 1), times its scale
        ones = mx.ones((codes.shape[0], s.shape[1] * group // 32), mx.float32)
        q = mx.dequantize(codes, ones, mx.zeros_like(ones), group_size=32, bits=bits)
        q = mx.array(IQ4_NL.kvalues, mx.float32)[q.astype(mx.int32)] if mode == "iq4_nl" else q - 2 ** (bits - 1)
        w = q.reshape(*s.shape, group) * s[..., None].astype(mx.float32)
        return x @ w.reshape(q.shape).T
    if group == 16:  # the codes, then q * scale + bias
        ones = mx.ones((codes.shape[0], s.shape[1] // 2), mx.float32)
        q = mx.dequantize(codes, ones, mx.zeros_like(ones), group_size=32, bits=bits)
        w = (q.reshape(*s.shape, 16) * s[..., None] + b[..., None]).reshape(q.shape)
    else:
        w = mx.dequantize(codes, s.astype(mx.float32), b.astype(mx.float32), group_size=group, bits=bits)
    return x @ w.T


@pytest.mark.parametrize(
    ("bits", "group", "mode"),
    [(b, g, "affine") for b in (4, 8, 2, 3, 5, 6) for g in (32, 64, 128)]
    + [(b, 16, "affine") for b in (2, 3, 5, 6, 8)]
    + [(4, g, "iq4_nl") for g in (32, 64)]
    + [(b, g, "symmetric") for b in (3, 6) for g in (16, 32)]
    + [(b, 32, "symmetric") for b in (4, 5, 8)]
    + [(b, 16, "symmetric") for b in (5, 8)],
)
def test_quantized_matmul_equals_float32_products_for_every_width_group_and_row_count(bits, group, mode):
    codes, s, b = quantized(96, 640, bits, group, seed=bits * group, mode=mode)
    for rows in ROWS:
        x = mx.random.normal((rows, 640), key=mx.random.key(rows))
        got = native.qmatmul(x, codes, s, b, group, bits, mode=mode)
        want = reference(x, codes, s, b, group, bits, mode)
        assert got.shape == (rows, 96) and got.dtype == mx.float32
        err = mx.abs(got - want).max().item() / mx.abs(want).max().item()
        assert err < TOLERANCE, f"{rows} rows: relative error {err:.2e}"


# K 576 (gate_proj's) and 1,536 (down_proj's: AVX2's halves take 3 to 8
# rows of it in blocks of K, the sums carried from one to the next); 6, 5
# and 3 bits are not halves': on AVX2 2 rows and more of them go through
# the scratch, and their codes are unpacked by a shuffle and shifts
# there (V::codes_bits), by a loop elsewhere; groups of 16 (GGUF's Q6_K
# and Q2_K) give each half of a 32-weight step its own scale; iq4_nl's
# codes are looked up (AVX2's byte shuffle, AVX-512's table, the scalar
# loop's index), with float16 scales (IQ4_NL's) and float32 (IQ4_XS's);
# symmetric codes' biases are made from their scales (Q6_K's and Q3_K's
# float32 ones in groups of 16, Q4_0's and Q8_0's float16 ones, halves' on
# AVX2; 8-bit codes in groups of 16, IQ2_XS's and IQ2_S's, never halves').
@pytest.mark.parametrize(
    ("bits", "k", "group", "mode"),
    [
        (4, 576, 32, "affine"),
        (8, 576, 32, "affine"),
        (4, 1536, 128, "affine"),
        (8, 1536, 64, "affine"),
        (6, 576, 64, "affine"),
        (5, 576, 32, "affine"),
        (3, 1536, 32, "affine"),
        (6, 1536, 16, "affine"),
        (2, 576, 16, "affine"),
        (4, 576, 32, "iq4_nl"),
        (4, 1536, 32, "iq4_nl"),
        (6, 1536, 16, "symmetric"),
        (3, 576, 16, "symmetric"),
        (4, 576, 32, "symmetric"),
        (8, 1536, 32, "symmetric"),
        (8, 576, 16, "symmetric"),
    ],
)
def test_a_row_is_bit_identical_alone_anywhere_in_a_product_and_on_every_instruction_set(bits, k, group, mode):
    scales = mx.float32 if (mode, group) == ("symmetric", 16) or (mode, k) == ("iq4_nl", 1536) else mx.float16
    codes, s, b = quantized(202, k, bits, group, seed=bits, scales=scales, mode=mode)  # a last block of 2 weight rows

    def product(x):
        return native.qmatmul(x, codes, s, b, group, bits, mode=mode)

    x = mx.random.normal((300, k), key=mx.random.key(7))
    whole = {}
    try:
        for isa in native.isas():
            native.set_isa(isa)
            whole[isa] = product(x)
            for at in (0, 1, 2, 3, 5, 16, 63, 64, 150, 299):  # the direct path's tiles, the scratch path's, chunk edges
                # one row's own path; on AVX-512 3 and 12 rows in passes of up to 6 (12: 6 + 6), 8, 9 and 17
                # in passes of up to 9 (17: 9 + 8); on AVX2 2 rows in a pass of 2, 3 to 8 in a pass of
                # halves, 9 rows and more through the scratch, as 33 everywhere
                for rows in (1, 2, 3, 4, 5, 8, 9, 12, 17, 33):
                    part = product(x[at : at + rows])
                    assert mx.array_equal(part, whole[isa][at : at + rows]).item(), f"{isa}: rows {at}+{rows}"
    finally:
        native.set_isa(native.isas()[0])
    first = next(iter(whole.values()))
    for isa, out in whole.items():  # the same sums in the same order: AVX-512, AVX2 and scalar agree
        assert mx.array_equal(out, first).item(), isa


@pytest.mark.parametrize(("bits", "group"), [(3, 16), (4, 32), (5, 32), (6, 16), (8, 32)])
def test_symmetric_codes_are_the_affine_products_with_their_biases_made_from_the_scales(bits, group):
    """Q3_K, Q4_0, Q5_0, Q6_K and Q8_0 kept without biases: the same bits as
    with the biases -2^(bits - 1) * scale stored (what MLX's GGUF reader
    makes of Q4_0 and Q8_0), the int8 products of 4 and 8 bits too (their
    pack made with those biases)."""
    scales = mx.float32 if group == 16 else mx.float16
    codes, s, _ = quantized(40, 576, bits, group, seed=bits, scales=scales, mode="symmetric")
    b = s * -(2 ** (bits - 1))
    x = mx.random.normal((9, 576), key=mx.random.key(bits))
    want = native.qmatmul(x, codes, s, b, group, bits)
    assert mx.array_equal(native.qmatmul(x, codes, s, None, group, bits, mode="symmetric"), want).item()
    if bits in (4, 8):
        packed = native.pack(codes, s, b, group, bits)
        want = native.qmatmul(x, codes, s, b, group, bits, packed=packed)
        got = native.qmatmul(x, codes, s, None, group, bits, packed=packed, mode="symmetric")
        assert mx.array_equal(got, want).item()


def test_scale_types_and_shapes_a_model_passes():
    codes, s, b = quantized(64, 256, 4, 64, seed=3, scales=mx.bfloat16)
    x = mx.random.normal((2, 5, 256), key=mx.random.key(1))  # (batch, tokens, features)
    got = native.qmatmul(x, codes, s, b, 64, 4)
    assert got.shape == (2, 5, 64)
    want = reference(x, codes, s, b, 64, 4)
    assert mx.abs(got - want).max().item() / mx.abs(want).max().item() < TOLERANCE
    strided = mx.random.normal((256, 6), key=mx.random.key(2)).T  # not row-contiguous
    assert mx.array_equal(
        native.qmatmul(strided, codes, s, b, 64, 4), native.qmatmul(mx.array(np.array(strided)), codes, s, b, 64, 4)
    ).item()
    half = native.qmatmul(x.astype(mx.float16), codes, s, b, 64, 4)
    assert half.dtype == mx.float16


def test_bad_arguments_are_refused_by_name():
    codes, s, b = quantized(8, 64, 4, 32, seed=0)
    cases = [
        ((mx.zeros((1, 64)), codes, s, b, 32, 7), "bits"),
        ((mx.zeros((1, 64)), codes, s, b, 16, 4), "group_size"),  # 16 takes the other widths
        ((mx.zeros((1, 64)), codes, s, b, 24, 4), "group_size"),
        ((mx.zeros((1, 63)), codes, s, b, 32, 4), "last dimension"),
        ((mx.zeros((1, 64)), codes.astype(mx.int32), s, b, 32, 4), "uint32"),
        ((mx.zeros((1, 64)), codes, s[:, :1], b[:, :1], 32, 4), "one value per group"),
        ((mx.zeros((1, 64), mx.int32), codes, s, b, 32, 4), "floating-point"),
    ]
    for args, words in cases:
        with pytest.raises(ValueError, match=words):
            native.qmatmul(*args)
    x = mx.zeros((1, 64))
    for args, mode, words in [
        ((x, codes, s, None, 32, 4), "nf4", "mode must be affine, iq4_nl or symmetric, not nf4"),
        ((x, codes, s, b, 32, 4), "iq4_nl", "iq4_nl takes no biases"),
        ((x, *quantized(8, 64, 2, 32, seed=0, mode="symmetric"), 32, 2), "symmetric", "symmetric codes are 3, 4,"),
        ((x, *quantized(8, 64, 6, 32, seed=0), 32, 6), "symmetric", "symmetric takes no biases"),
        ((x, codes, s, None, 32, 8), "iq4_nl", "iq4_nl codes are 4 bits"),
        ((x, codes, s, None, 32, 4), "affine", "scales and biases"),
    ]:
        with pytest.raises(ValueError, match=words):
            native.qmatmul(*args, mode=mode)
    with pytest.raises(ValueError, match="int8 products take affine and symmetric codes, not iq4_nl"):
        native.qmatmul(x, codes, s, None, 32, 4, packed=native.pack(codes, s, b, 32, 4), mode="iq4_nl")
    with pytest.raises(ValueError, match="no kernel named"):
        native.set_isa("sse9")


def test_fused_norm_and_rope_equal_mx_fast():
    x = mx.random.normal((6, 9, 1, 64), key=mx.random.key(4))
    w = mx.random.normal((64,), key=mx.random.key(5))
    assert mx.abs(native.rms_norm(x, w, 1e-5) - mx.fast.rms_norm(x, w, 1e-5)).max().item() < 1e-5
    offsets = mx.array([0, 1, 17, 255, 1000, 2047])
    freqs = mx.random.uniform(1, 100, (24,), key=mx.random.key(6))
    for traditional in (True, False):
        for offset in (mx.array(9), offsets):
            got = native.rope(x, offset, 48, traditional, 10000.0, 1.0)
            want = mx.fast.rope(x, 48, traditional=traditional, base=10000.0, scale=1.0, offset=offset)
            # MLX's CPU cos and sin are approximations: apart by ~1e-4 at position 2047, libm's are exact
            assert mx.abs(got - want).max().item() < 5e-4
            got = native.rope(x, offset, 48, traditional, 10000.0, 1.0, freqs)
            want = mx.fast.rope(x, 48, traditional=traditional, base=None, scale=1.0, offset=offset, freqs=freqs)
            assert mx.abs(got - want).max().item() < 5e-4
    one = native.rope(x[2:3], offsets[2:3], 64, True, 10000.0, 1.0)  # a row alone, as in the batch
    assert mx.array_equal(one, native.rope(x, offsets, 64, True, 10000.0, 1.0)[2:3]).item()


def _attend(q, keys, values, length, mask=None):
    """native.attend for one session's decode rows whose keys are already
    in its (float16) slab (no writes): its rows over slots [0, length)."""
    out, _, _ = native.attend(
        q,
        keys[..., : q.shape[0], :].astype(mx.float32),
        values[..., : q.shape[0], :].astype(mx.float32),
        [keys, values],
        [[]],
        [[0, q.shape[0], length, -1 if mask is None else 0]],
        [] if mask is None else [mask],
        [False],
    )
    return out


def _reference(q, keys, values, mask):
    """MLX's attention of q (rows, heads, 1, D) over keys and values (1, kv,
    slots, D), widened to float32, plus an additive (rows, slots) mask."""
    rows, heads, _, d = q.shape
    kv = keys.shape[1]
    scores = q.reshape(rows, kv, heads // kv, d) @ keys.astype(mx.float32).swapaxes(-1, -2)
    if mask is not None:
        scores = scores + mask.reshape(rows, 1, 1, -1)
    return (mx.softmax(scores, axis=-1, precise=True) @ values.astype(mx.float32)).reshape(1, rows, heads * d)


def test_fused_attention_equals_mlx_softmax_path_and_a_row_is_alone():
    """Decode rows over a slab (grouped-query: 9 heads on 3 KV heads), with
    and without a mask: MLX's own products and precise softmax to float32
    rounding; each row bit-identical alone and on every instruction set."""
    rows, heads, kv, d, slots, length = 5, 9, 3, 64, 300, 257
    q = mx.random.normal((rows, heads, 1, d), key=mx.random.key(10)) * 0.125
    keys, values = (mx.random.normal((1, kv, slots, d), key=mx.random.key(i)).astype(mx.float16) for i in (11, 12))
    mask = np.zeros((rows, length), np.float32)
    mask[:, 200:], mask[1, :3] = -np.inf, -np.inf
    for m in (None, mx.array(mask)):
        got = _attend(q, keys, values, length, m)
        want = _reference(q, keys[..., :length, :], values[..., :length, :], m)
        assert got.shape == (1, rows, heads * d) and mx.abs(got - want).max().item() < 1e-5
        for r in range(rows):
            alone = _attend(q[r : r + 1], keys, values, length, None if m is None else m[r : r + 1])
            assert mx.array_equal(alone[0, 0], got[0, r]).item()
    outs = []
    try:
        for isa in native.isas():
            native.set_isa(isa)
            outs.append(_attend(q, keys, values, length, mx.array(mask)))
    finally:
        native.set_isa(native.isas()[0])
    assert all(mx.array_equal(o, outs[0]).item() for o in outs)
    with pytest.raises(ValueError, match="length"):
        _attend(q, keys, values, slots + 1)
    with pytest.raises(ValueError, match="slabs must be float16"):
        _attend(q, keys.astype(mx.float32), values.astype(mx.float32), length)
    # A head size that is no multiple of the kernel's 16 lanes (a tiny draft model's).
    q, keys, values = q[..., :40], keys[..., :40], values[..., :40]
    want = _reference(q, keys[..., :length, :], values[..., :length, :], None)
    assert mx.abs(_attend(q, keys, values, length) - want).max().item() < 1e-5


def test_a_chunk_reads_its_slab_as_it_stood_then_writes():
    """A prefill chunk longer than its ring's free slots: its rows attend
    over the slab as it stood (masked by the positions its slots hold) and
    over its own keys causally, as MLX's attention over both, though its
    writes overwrite slots its first rows see; its keys and values land in
    the slab after, as float16 (nearest)."""
    heads, kv, d, slots, n = 6, 2, 64, 40, 24
    q = mx.random.normal((n, heads, 1, d), key=mx.random.key(40)) * 0.125
    new_k, new_v = (mx.random.normal((1, kv, n, d), key=mx.random.key(i)) for i in (41, 42))
    slab = [mx.random.normal((1, kv, slots, d), key=mx.random.key(i)).astype(mx.float16) for i in (43, 44)]
    mx.eval(q, new_k, new_v, slab)
    before = [mx.array(a) for a in slab]
    mask = np.zeros((n, slots + n), np.float32)
    mask[:, :5] = -np.inf  # slots holding nothing
    dropped = np.arange(20)[None, :] < np.arange(n)[:, None]  # the oldest slots, dropped row by row
    mask[:, 10:30] = np.where(dropped, -np.inf, 0)
    mask[:, slots:][np.triu(np.ones((n, n), bool), 1)] = -np.inf  # causal over its own
    writes = [[10, 0, 20, 0, 20, 4]]  # over the slab's slots 10-29 (seen by the first rows), then 0-3
    out, k, v = native.attend(q, new_k, new_v, slab, writes, [[0, n, slots, 0]], [mx.array(mask)], [True])
    both_k = mx.concatenate([before[0], new_k.astype(mx.float16)], axis=2)
    both_v = mx.concatenate([before[1], new_v.astype(mx.float16)], axis=2)
    assert mx.abs(out - _reference(q, both_k, both_v, mx.array(mask))).max().item() < 1e-5
    assert mx.array_equal(k[..., 10:30, :], new_k[..., :20, :].astype(mx.float16)).item()
    assert mx.array_equal(v[..., :4, :], new_v[..., 20:, :].astype(mx.float16)).item()
    assert mx.array_equal(k[..., 30:, :], before[0][..., 30:, :]).item()
    with pytest.raises(ValueError, match="chunk's read needs a mask"):
        native.attend(q, new_k, new_v, slab, writes, [[0, n, slots, -1]], [], [True])


def test_a_chunk_row_is_the_same_in_a_longer_chunk_and_on_every_instruction_set():
    """A chunk's rows are lanes of its items (16 rows an item, their query
    heads together): a row's output is the same bits whatever rows share
    its item (the first 21 rows of a 40-row chunk against those rows
    alone, both over 700 slots, two parts, one of them masked in
    places), equals MLX's attention to float32 rounding, and is the same
    on every instruction set."""
    heads, kv, d, slots, n = 9, 3, 64, 700, 40
    q = mx.random.normal((n, heads, 1, d), key=mx.random.key(60)) * 0.125
    new_k, new_v = (mx.random.normal((1, kv, n, d), key=mx.random.key(i)) for i in (61, 62))
    slab = [mx.random.normal((1, kv, slots, d), key=mx.random.key(i)).astype(mx.float16) for i in (63, 64)]
    mask = np.zeros((n, slots + n), np.float32)
    mask[:, 600:] = -np.inf  # slots holding nothing
    mask[:, :30] = np.where(
        np.arange(30)[None, :] + 5 < np.arange(n)[:, None], -np.inf, 0
    )  # the oldest, dropped row by row
    mask[:, slots:][np.triu(np.ones((n, n), bool), 1)] = -np.inf
    mask[7, 100] = 0.5  # an additive mask need not be 0 or -inf

    def chunk(rows):
        out, _, _ = native.attend(
            q[:rows],
            new_k[..., :rows, :],
            new_v[..., :rows, :],
            slab,
            [[0, 0, 1]],
            [[0, rows, slots, 0]],
            [mx.array(np.concatenate([mask[:rows, :slots], mask[:rows, slots : slots + rows]], 1))],
            [True],
        )
        return out

    outs = []
    try:
        for isa in native.isas():
            native.set_isa(isa)
            outs.append((chunk(n), chunk(21)))
    finally:
        native.set_isa(native.isas()[0])
    whole, part = outs[0]
    assert mx.array_equal(whole[:, :21], part).item()
    assert all(mx.array_equal(a, whole).item() and mx.array_equal(b, part).item() for a, b in outs)
    both_k = mx.concatenate([slab[0], new_k.astype(mx.float16)], axis=2)
    both_v = mx.concatenate([slab[1], new_v.astype(mx.float16)], axis=2)
    assert mx.abs(whole - _reference(q, both_k, both_v, mx.array(mask))).max().item() < 1e-5


def test_decode_rows_write_each_session_into_its_slab_then_attend():
    """Two sessions in one op: each one's new keys and values land in its
    own slab's slots (a run that wraps to the ring's start included), the
    slab a caller still holds is left as it was, and each session's rows
    equal its own op alone."""
    heads, kv, d = 6, 2, 16
    q = mx.random.normal((3, heads, 1, d), key=mx.random.key(20))
    new_k, new_v = (mx.random.normal((1, kv, 3, d), key=mx.random.key(i)) for i in (21, 22))
    slab_a = [mx.random.normal((1, kv, 8, d), key=mx.random.key(i)).astype(mx.float16) for i in (23, 24)]
    slab_b = [mx.random.normal((1, kv, 5, d), key=mx.random.key(i)).astype(mx.float16) for i in (25, 26)]
    mx.eval(q, new_k, new_v, slab_a, slab_b)
    held = [mx.array(a) for a in slab_a]  # copies to compare with: slab_a itself is still held here
    # Session a: pass row 0 into slot 7; session b: rows 1-2 into slots 4 and 0 (wrapped).
    writes = [[7, 0, 1], [4, 1, 1, 0, 2, 1]]
    reads = [[0, 1, 8, -1], [1, 3, 5, 0]]
    mask = mx.array(np.array([[0, 0, 0, 0, 0], [0, -np.inf, 0, 0, 0]], np.float32))
    out, ka, va, kb, vb = native.attend(q, new_k, new_v, [*slab_a, *slab_b], writes, reads, [mask], [False, False])
    assert mx.array_equal(slab_a[0], held[0]).item()  # held elsewhere: copied, not written in place
    half_k, half_v = new_k.astype(mx.float16), new_v.astype(mx.float16)
    assert (
        mx.array_equal(ka[..., 7, :], half_k[..., 0, :]).item()
        and mx.array_equal(va[..., :7, :], held[1][..., :7, :]).item()
    )
    assert (
        mx.array_equal(kb[..., 4, :], half_k[..., 1, :]).item()
        and mx.array_equal(vb[..., 0, :], half_v[..., 2, :]).item()
    )
    alone_a = _attend(q[:1], ka, va, 8)
    alone_b = _attend(q[1:], kb, vb, 5, mask)
    assert mx.array_equal(out, mx.concatenate([alone_a, alone_b], axis=1)).item()
    with pytest.raises(ValueError, match="write must fit"):
        native.attend(q, new_k, new_v, [*slab_a], [[8, 0, 1]], [[0, 1, 8, -1]], [], [False])
    # A slab held by nothing else (as a session's, which takes the op's
    # outputs back) is written in place, not copied.
    slab = [mx.random.normal((1, kv, 8, d), key=mx.random.key(i)).astype(mx.float16) for i in (27, 28)]
    mx.eval(slab)
    where = _address(slab[0])
    first = (q[:1], new_k[..., :1, :], new_v[..., :1, :])
    out, *slab = native.attend(*first, slab, [[7, 0, 1]], [[0, 1, 8, -1]], [], [False])
    mx.eval(out, slab)
    assert _address(slab[0]) == where and mx.array_equal(slab[0][..., 7, :], half_k[..., 0, :]).item()


def _address(a: mx.array) -> int:
    """Where an array's data lives (NumPy's view of it, released at once)."""
    return np.asarray(a).__array_interface__["data"][0]


def _layer(hidden: int, heads: int, kv_heads: int, inner: int, modes: dict[str, str] | None = None):
    """A llama-style layer's weights: norms and seven projections (codes,
    scales, biases, group, bits, mode each), the projections of two widths
    (Q4_K files keep some at 6 or 8 bits), those `modes` names of theirs."""
    d = hidden // heads
    shapes = {"q": (heads * d, hidden), "k": (kv_heads * d, hidden), "v": (kv_heads * d, hidden)}
    shapes |= {"o": (hidden, hidden), "gate": (inner, hidden), "up": (inner, hidden), "down": (hidden, inner)}
    widths, modes = {"v": 8, "down": 6}, modes or {}
    layer = {
        name: (
            *quantized(*shape, widths.get(name, 4), 32, seed=i, mode=modes.get(name, "affine")),
            32,
            widths.get(name, 4),
            modes.get(name, "affine"),
        )
        for i, (name, shape) in enumerate(shapes.items())
    }
    norms = [mx.random.uniform(0.5, 1.5, (hidden,), key=mx.random.key(40 + i)) for i in range(2)]
    return layer, norms


def _arrays(layer, *names):
    """The layer ops' arrays (a projection without biases: an empty array), groups and bits."""
    arrays = [a if a is not None else mx.array([]) for n in names for a in layer[n][:3]]
    return arrays, [layer[n][3] for n in names], [layer[n][4] for n in names]


def _modes(layer, *names):
    return [layer[n][5] for n in names]


def test_a_layers_fused_halves_equal_the_separate_ops_and_a_row_is_alone():
    """attention_in and qmatmul's residual are the separate native ops'
    arithmetic, bit for bit; the MLP's swiglu uses an exp of its own (within
    float32 rounding of MLX's), the same bits on every instruction set; each
    row bit-identical alone. Its k and up projections are iq4_nl's, its
    down projection symmetric."""
    hidden, heads, kv, inner, tokens = 128, 4, 2, 320, 17
    d = hidden // heads
    layer, (norm1, norm2) = _layer(hidden, heads, kv, inner, modes={"k": "iq4_nl", "up": "iq4_nl", "down": "symmetric"})
    qkv, mlp = {"modes": _modes(layer, "q", "k", "v")}, {"modes": _modes(layer, "gate", "up", "down")}
    h = mx.random.normal((1, tokens, hidden), key=mx.random.key(50))
    positions = mx.array([3 * t + 7 for t in range(tokens)])
    scale = d**-0.5

    def q_(name, x):
        codes, s, b, group, bits, mode = layer[name]
        return native.qmatmul(x, codes, s, b, group, bits, mode=mode)

    queries, keys, values = native.attention_in(
        h, norm1, 1e-5, *_arrays(layer, "q", "k", "v"), heads, kv, scale, positions, d, False, 10000.0, 1.0, **qkv
    )
    x = native.rms_norm(h, norm1, 1e-5)
    q = q_("q", x).reshape(tokens, heads, 1, d)
    k = q_("k", x).reshape(tokens, kv, 1, d)
    rows = native.rope(mx.concatenate([q * scale, k], axis=1), positions, d, False, 10000.0, 1.0)
    assert mx.array_equal(queries, rows[:, :heads]).item()
    assert mx.array_equal(keys, rows[:, heads:].transpose(2, 1, 0, 3)).item()
    assert mx.array_equal(values, q_("v", x).reshape(tokens, kv, 1, d).transpose(2, 1, 0, 3)).item()

    attended = mx.random.normal((1, tokens, hidden), key=mx.random.key(51))
    codes, s, b, group, bits, _ = layer["o"]
    assert mx.array_equal(native.qmatmul(attended, codes, s, b, group, bits, residual=h), h + q_("o", attended)).item()

    out = native.mlp(h, norm2, 1e-5, *_arrays(layer, "gate", "up", "down"), **mlp)
    x = native.rms_norm(h, norm2, 1e-5)
    want = h + q_("down", mx.sigmoid(q_("gate", x)) * q_("gate", x) * q_("up", x))
    assert out.shape == h.shape and mx.abs(out - want).max().item() < 1e-5 * mx.abs(want).max().item()
    try:
        for isa in native.isas():  # swiglu.h's loop as each instruction set's file vectorises it
            native.set_isa(isa)
            assert mx.array_equal(native.mlp(h, norm2, 1e-5, *_arrays(layer, "gate", "up", "down"), **mlp), out).item()
    finally:
        native.set_isa(native.isas()[0])

    for t in (0, 5, tokens - 1):  # a token alone, as a decode step runs it
        one = native.attention_in(
            h[:, t : t + 1],
            norm1,
            1e-5,
            *_arrays(layer, "q", "k", "v"),
            heads,
            kv,
            scale,
            positions[t : t + 1],
            d,
            False,
            10000.0,
            1.0,
            **qkv,
        )
        assert (
            mx.array_equal(one[0][0], queries[t]).item() and mx.array_equal(one[1][..., 0, :], keys[..., t, :]).item()
        )
        alone = native.mlp(h[:, t : t + 1], norm2, 1e-5, *_arrays(layer, "gate", "up", "down"), **mlp)
        assert mx.array_equal(alone[0, 0], out[0, t]).item()
    with pytest.raises(ValueError, match="multiple of the kv heads"):
        native.attention_in(
            h, norm1, 1e-5, *_arrays(layer, "q", "k", "v"), 3, 2, scale, positions, d, False, 1e4, 1.0, **qkv
        )
    with pytest.raises(ValueError, match="expected 3 projections"):
        native.mlp(h, norm2, 1e-5, *_arrays(layer, "gate", "up"))
    with pytest.raises(ValueError, match="scales and biases"):  # up's empty biases, its mode not said
        native.mlp(h, norm2, 1e-5, *_arrays(layer, "gate", "up", "down"), modes=["affine"] * 3)
    with pytest.raises(ValueError, match="mode must be affine, iq4_nl or symmetric"):
        native.mlp(h, norm2, 1e-5, *_arrays(layer, "gate", "up", "down"), modes=["affine", "iq4", "affine"])
    with pytest.raises(ValueError, match="residual"):
        native.qmatmul(attended, codes, s, b, group, bits, residual=h[:, :3])


def int8_reference(x, codes, s, b, group, bits):
    """The int8 products' arithmetic (src/kernels.h) in float64: x rounded
    to int8 per 32 weights, the codes less their middle, the biases plus it
    times x's exact sums per group."""
    x = np.array(x, dtype=np.float32)
    q = np.array(mx.dequantize(codes, mx.ones_like(s), mx.zeros_like(b), group_size=group, bits=bits), np.float64)
    rows, k = x.shape
    blocks = x.reshape(rows, k // 32, 32)
    d = np.abs(blocks).max(-1) / np.float32(127)
    inverse = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    x8 = np.rint((blocks * inverse[..., None]).astype(np.float32))  # ties to even
    rounded = (x8 * d[..., None]).reshape(rows, k).astype(np.float64)
    middle = 2 ** (bits - 1)
    scales, biases = (np.array(a.astype(mx.float32), np.float64) for a in (s, b))
    w = ((q.reshape(q.shape[0], -1, group) - middle) * scales[..., None]).reshape(q.shape[0], -1)
    sums = x.reshape(rows, -1, group).astype(np.float64).sum(-1)
    return rounded @ w.T + sums @ (biases + middle * scales).T


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int8_products_are_their_arithmetic_for_every_group_and_row_count(bits, group):
    """Against their arithmetic in float64: to float32's rounding of the
    sums. Against the exact products: ~0.5 % off (x's rounding to int8)."""
    codes, s, b = quantized(90, 640, bits, group, seed=bits * group)  # 90 rows: a last packed block of 10
    packed = native.pack(codes, s, b, group, bits)
    for rows in ROWS:
        x = mx.random.normal((rows, 640), key=mx.random.key(rows))
        got = native.qmatmul(x, codes, s, b, group, bits, packed=packed)
        assert got.shape == (rows, 90) and got.dtype == mx.float32
        want = int8_reference(x, codes, s, b, group, bits)
        err = np.abs(np.array(got) - want).max() / np.abs(want).max()
        assert err < TOLERANCE, f"{rows} rows: relative error {err:.2e}"
        exact = native.qmatmul(x, codes, s, b, group, bits)
        off = (mx.sqrt(((got - exact) ** 2).sum()) / mx.sqrt((exact**2).sum())).item()
        assert 1e-3 < off < 1e-2, f"{rows} rows: {off:.4f} off the exact products"


@pytest.mark.parametrize("bits", [4, 8])
def test_an_int8_row_is_bit_identical_alone_anywhere_and_on_every_instruction_set(bits):
    codes, s, b = quantized(202, 576, bits, 32, seed=bits)
    packed = native.pack(codes, s, b, 32, bits)
    x = mx.random.normal((300, 576), key=mx.random.key(7))
    whole = {}
    try:
        for isa in native.isas():
            native.set_isa(isa)
            whole[isa] = native.qmatmul(x, codes, s, b, 32, bits, packed=packed)
            for at in (0, 5, 63, 64, 150, 299):  # passes of up to 8 rows (AVX-512), 4 (AVX2), 1; items of 64
                for rows in (1, 3, 8, 9, 17, 65):
                    part = native.qmatmul(x[at : at + rows], codes, s, b, 32, bits, packed=packed)
                    assert mx.array_equal(part, whole[isa][at : at + rows]).item(), f"{isa}: rows {at}+{rows}"
    finally:
        native.set_isa(native.isas()[0])
    first = next(iter(whole.values()))
    for isa, out in whole.items():  # integer sums, then the same float operations in the same order
        assert mx.array_equal(out, first).item(), isa


def test_int8_products_refuse_what_they_cannot_take_and_keep_a_nan_to_its_row():
    codes, s, b = quantized(16, 64, 4, 32, seed=0)
    packed = native.pack(codes, s, b, 32, 4)
    six = quantized(16, 64, 6, 32, seed=0)
    with pytest.raises(ValueError, match="4- and 8-bit"):
        native.pack(*six, 32, 6)
    with pytest.raises(ValueError, match="groups of 32 or more"):
        native.pack(*quantized(16, 64, 8, 16, seed=0), 16, 8)
    other = native.pack(*quantized(32, 64, 4, 32, seed=1), 32, 4)
    x = mx.random.normal((3, 64), key=mx.random.key(2))
    for wrong in (other, packed[:1], [packed[0], packed[1].astype(mx.float32)]):
        with pytest.raises(ValueError, match="packed"):
            native.qmatmul(x, codes, s, b, 32, 4, packed=wrong)
    out = np.array(native.qmatmul(x.at[1, 5].add(np.nan), codes, s, b, 32, 4, packed=packed))
    assert np.isnan(out[1]).all() and np.isfinite(out[[0, 2]]).all()


def test_a_layers_fused_halves_take_the_int8_products():
    """With each projection's pack: attention_in's values and qmatmul's
    residual are the int8 qmatmul's, bit for bit, the MLP within swiglu's
    exp of the separate ops; a row alone is the same."""
    hidden, heads, kv, inner, tokens = 128, 4, 2, 320, 17
    d = hidden // heads
    layer, (norm1, norm2) = _layer(hidden, heads, kv, inner)
    packs = {name: native.pack(*layer[name][:5]) for name in layer if layer[name][4] in (4, 8)}
    packs["down"] = [mx.array([], mx.uint8)] * 2  # 6 bits: its exact products
    h = mx.random.normal((1, tokens, hidden), key=mx.random.key(60))
    positions = mx.array(list(range(tokens)))

    def q_(name, x):
        codes, s, b, group, bits, _ = layer[name]
        return native.qmatmul(x, codes, s, b, group, bits, packed=packs[name] if name != "down" else [])

    def packed(*names):
        return [a for n in names for a in packs[n]]

    _, _, values = native.attention_in(
        h,
        norm1,
        1e-5,
        *_arrays(layer, "q", "k", "v"),
        heads,
        kv,
        d**-0.5,
        positions,
        d,
        False,
        1e4,
        1.0,
        packed=packed("q", "k", "v"),
    )
    x = native.rms_norm(h, norm1, 1e-5)
    assert mx.array_equal(values, q_("v", x).reshape(tokens, kv, 1, d).transpose(2, 1, 0, 3)).item()
    out = native.mlp(h, norm2, 1e-5, *_arrays(layer, "gate", "up", "down"), packed=packed("gate", "up", "down"))
    x = native.rms_norm(h, norm2, 1e-5)
    want = h + q_("down", mx.sigmoid(q_("gate", x)) * q_("gate", x) * q_("up", x))
    assert mx.abs(out - want).max().item() < 1e-5 * mx.abs(want).max().item()
    alone = native.mlp(
        h[:, 4:5], norm2, 1e-5, *_arrays(layer, "gate", "up", "down"), packed=packed("gate", "up", "down")
    )
    assert mx.array_equal(alone[0, 0], out[0, 4]).item()
    with pytest.raises(ValueError, match="packed"):
        native.mlp(h, norm2, 1e-5, *_arrays(layer, "gate", "up", "down"), packed=packed("gate", "up"))


VOCAB = 49152  # SmolLM2's
# (temperature, top_p, top_k): a temperature alone, top-p, top-k, both.
SAMPLINGS = [(1.0, 1.0, 0), (0.7, 0.9, 0), (0.7, 1.0, 40), (1.5, 0.95, 50), (0.3, 0.5, 3)]


def _logit_rows() -> mx.array:
    """Two rows of a vocabulary's logits: flat (thousands of tokens in a
    0.9 nucleus) and peaked (tens), a stretch masked out (-inf, as a
    grammar masks tokens) and a tie for the highest in the second."""
    flat = mx.random.normal((VOCAB,), key=mx.random.key(5)) * 3
    ids = mx.arange(VOCAB)
    peaked = flat * 0.5 + mx.where(ids % 997 == 0, 12.0, 0.0)
    peaked = mx.where(ids == 997 * 7, peaked.max(), peaked)
    return mx.where((ids >= 1000) & (ids < 1100), -mx.inf, mx.stack([flat, peaked]))


def test_the_sampler_at_temperature_zero_takes_mx_argmaxs_token():
    rows = _logit_rows()
    assert native.sample(rows, 0.0, 1.0, 0, []).tolist() == mx.argmax(rows, axis=-1).tolist()
    assert native.sample(mx.array([[1.0, 3.0, 3.0, -2.0]]), 0.0, 1.0, 0, []).tolist() == [1]  # a tie: the first
    assert native.sample(mx.array([-mx.inf, -mx.inf]), 0.0, 1.0, 0, []).item() == 0


@pytest.mark.parametrize(("temperature", "top_p", "top_k"), SAMPLINGS)
def test_the_samplers_distribution_is_mlx_lms_chains(temperature, top_p, top_k):
    """Against mlx-lm's top-p, top-k and temperature (worker/speculative.py's
    MLX path). mlx-lm sums top-p's mass in float32: a token whose mass above
    it is within float32's error of the bound may stay on one side only."""
    from kvmux.worker.speculative import distributions

    rows = _logit_rows()
    want = distributions(rows, temperature, top_p, top_k)
    got = np.asarray(native.distribution(rows, temperature, top_p, top_k), dtype=np.float64)
    for logits, w, g in zip(np.asarray(rows, dtype=np.float64), want, got, strict=True):
        assert abs(g.sum() - 1) < 1e-5 and not g[1000:1100].any()
        assert 0.5 * np.abs(w - g).sum() < 1e-3
        differ = np.nonzero((w > 0) != (g > 0))[0]
        if top_p == 1.0 or top_k:
            assert differ.size == 0
        order = np.argsort(-logits, kind="stable")
        weights = np.exp(logits - logits.max())
        above = np.concatenate([[0.0], np.cumsum(weights[order])])[np.argsort(order)] / weights.sum()
        assert (np.abs(above[differ] - top_p) < 1e-4).all()


def test_the_sampler_keeps_every_token_for_top_p_one_and_top_k_past_the_vocabulary():
    rows = _logit_rows()
    every = np.asarray(native.distribution(rows, 0.8, 1.0, 0))
    assert np.array_equal(np.asarray(native.distribution(rows, 0.8, 1.0, VOCAB)), every)
    assert np.array_equal(np.asarray(native.distribution(rows, 0.8, 0.0, -1)), every)
    assert (every[:, :1000] > 0).all()


@pytest.mark.parametrize(("temperature", "top_p", "top_k"), SAMPLINGS)
def test_the_sampler_draws_each_token_by_its_share_of_the_uniform_numbers(temperature, top_p, top_k):
    """Uniform numbers on an even grid draw each token as often as its
    probability says, to the grid's step: the draw is the distribution's
    inverse, one uniform number a token, each row's its own."""
    rows = _logit_rows()[1:]
    p = np.asarray(native.distribution(rows, temperature, top_p, top_k), dtype=np.float64)[0]
    n = 4000
    grid = ((np.arange(n) + 0.5) / n).tolist()
    tokens = np.asarray(native.sample(mx.repeat(rows, n, axis=0), temperature, top_p, top_k, grid))
    assert not np.isin(tokens, np.nonzero(p == 0)[0]).any()
    counts = np.bincount(tokens, minlength=VOCAB) / n
    assert np.abs(counts - p).max() <= 1.0 / n + 1e-6
    alone = [native.sample(rows, temperature, top_p, top_k, [u]).item() for u in grid[::500]]
    assert alone == tokens[::500].tolist()
    try:  # the same distribution on every instruction set
        for isa in native.isas():
            native.set_isa(isa)
            assert np.array_equal(np.asarray(native.distribution(rows, temperature, top_p, top_k))[0], p)
    finally:
        native.set_isa(native.isas()[0])


def test_the_sampler_refuses_bad_arguments_by_name():
    rows = _logit_rows()
    for call, says in (
        (lambda: native.sample(rows, 1.0, 1.0, 0, [0.5]), "one uniform number per row"),
        (lambda: native.sample(rows, 1.0, 1.0, 0, [0.5, 1.0]), "in [0, 1)"),
        (lambda: native.sample(rows, -1.0, 1.0, 0, []), "temperature"),
        (lambda: native.distribution(mx.array([[1, 2]]), 1.0, 1.0, 0), "floating-point"),
        (lambda: native.distribution(mx.zeros((2, 0)), 1.0, 1.0, 0), "at least one token"),
    ):
        with pytest.raises(ValueError, match=re.escape(says)):
            call()


@pytest.fixture(scope="module")
def models():
    from kvmux.worker.model import load

    return load(kernel="auto"), load(kernel="off")


def test_a_model_on_the_int8_products_packs_its_weights_and_keeps_its_tokens(models):
    """`--cpu-products int8`: every 4- and 8-bit matrix packed (the same
    bytes again), logits within ~1 % of the exact products', greedy tokens
    the exact products' but at near ties; refused without the kernel."""
    from kvmux.worker import cpu_kernel
    from kvmux.worker.forward import Floors, Segment, forward
    from kvmux.worker.model import load

    int8 = load(kernel="auto", products="int8")
    assert int8.kernel.describe().endswith(", int8 products")
    layers = dict(int8.model.named_modules())
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.29.mlp.down_proj", "model.embed_tokens"):
        assert len(cpu_kernel.packed(layers[name])) == 2, name
    prompt = mx.array(np.random.default_rng(0).integers(100, 20000, 200))
    pair = (models[0], int8)
    slabs = [loaded.make_slab(4, 2048, 0) for loaded in pair]
    steps = [
        [forward(loaded.model, [Segment(prompt, slab)], Floors())[0]] for loaded, slab in zip(pair, slabs, strict=True)
    ]
    for _ in range(16):
        token = mx.argmax(steps[0][-1][-1]).reshape(1)  # the exact products' greedy token, fed to both
        for loaded, slab, own in zip(pair, slabs, steps, strict=True):
            own.append(forward(loaded.model, [Segment(token, slab, True)], Floors())[0])
    exact, got = (mx.concatenate(own) for own in steps)
    tokens = mx.argmax(exact, axis=-1)
    off = (mx.sqrt(((got - exact) ** 2).sum(-1)) / mx.sqrt((exact**2).sum(-1))).max().item()
    assert off < 0.05, f"logits {off:.3f} off the exact products'"
    top = np.sort(np.array(exact), axis=-1)[:, -2:]
    near = (top[:, 1] - top[:, 0]) < 0.5  # a choice within half a logit of the runner-up
    agree = np.array(mx.argmax(got, axis=-1) == tokens)
    assert (agree | near).all()
    with pytest.raises(ValueError, match="cpu_products int8 needs kvmux_native"):
        load(kernel="off", products="int8")


def test_the_model_reads_its_weights_as_stored(models):
    from mlx import nn

    from kvmux.worker import cpu_kernel

    kernel, fallback = models
    assert kernel.quantized and kernel.kernel.isa == native.isas()[0]
    assert not fallback.quantized and fallback.kernel.describe() == "none (off)"
    layers = dict(kernel.model.named_modules())
    assert isinstance(layers["model.layers.0.self_attn.q_proj"], cpu_kernel.QuantizedLinear)
    assert isinstance(layers["model.embed_tokens"], cpu_kernel.QuantizedEmbedding)
    # Q8_0's biases are -128 times its scales: symmetric, none kept; Q4_1's stay.
    assert layers["model.embed_tokens"].mode == "symmetric" and "biases" not in layers["model.embed_tokens"]
    assert layers["model.layers.0.self_attn.q_proj"].mode == "affine"
    assert isinstance(layers["model.norm"], cpu_kernel.RMSNorm)
    assert all(cpu_kernel.fused(layer) for layer in kernel.model.model.layers)  # a llama block: three ops a layer
    params = dict(nn.utils.tree_flatten(kernel.model.parameters()))
    bytes_kept = sum(v.nbytes for v in params.values())
    bytes_float = sum(v.nbytes for v in dict(nn.utils.tree_flatten(fallback.model.parameters())).values())
    assert bytes_kept < 0.25 * bytes_float  # 96 MB of Q4_1 + Q8_0 (+ float32 norms) against 538 MB
    # A real projection and the Q8_0 head: the kernel against the float32 copy's products.
    q_proj = layers["model.layers.3.self_attn.q_proj"]
    x = mx.random.normal((5, q_proj.weight.shape[1] * 32 // q_proj.bits), key=mx.random.key(8))
    want = x @ dict(fallback.model.named_modules())["model.layers.3.self_attn.q_proj"].weight.T
    assert mx.abs(q_proj(x) - want).max().item() / mx.abs(want).max().item() < TOLERANCE
    h = mx.random.normal((3, 576), key=mx.random.key(9))
    want = fallback.model.model.embed_tokens.as_linear(h)
    assert (
        mx.abs(kernel.model.model.embed_tokens.as_linear(h) - want).max().item() / mx.abs(want).max().item() < TOLERANCE
    )
    tokens = mx.array([1, 500, 9000])
    assert mx.array_equal(kernel.model.model.embed_tokens(tokens), fallback.model.model.embed_tokens(tokens)).item()


def test_whole_model_logits_equal_the_float32_copys(models):
    """A 200-token prompt and 16 decode steps: the same logits to a few
    parts in a million, the same greedy tokens."""
    from kvmux.worker.forward import Floors, Segment, forward

    rng = np.random.default_rng(0)
    prompt = mx.array(rng.integers(100, 20000, 200))
    outs = []
    for loaded in models:
        slab = loaded.make_slab(4, 2048, 0)
        logits = forward(loaded.model, [Segment(prompt, slab)], Floors())[0]
        steps = [logits]
        for _ in range(16):
            token = mx.argmax(steps[-1][-1]).reshape(1)
            steps.append(forward(loaded.model, [Segment(token, slab, True)], Floors())[0])
        outs.append(mx.concatenate(steps))
    kernel, fallback = outs
    assert mx.array_equal(mx.argmax(kernel, axis=-1), mx.argmax(fallback, axis=-1)).item()
    assert mx.abs(kernel - fallback).max().item() < 1e-3 * mx.abs(fallback).max().item()


def test_a_slab_crosses_between_the_kernel_and_the_float32_path(models):
    """The kernel's slabs hold float16 keys and values (half the bytes), the
    float32 path's float32. A slab one path wrote (a snapshot a worker on
    the other path restores) is taken up by the other, converted once, and
    its next logits are those that path gives its own slab, to the keys'
    float16 rounding."""
    from kvmux.worker.forward import Floors, Segment, forward

    prompt = mx.array(np.random.default_rng(1).integers(100, 20000, 64))
    token = mx.array([1234])
    slabs, nexts = [], []
    for loaded in models:
        slab = loaded.make_slab(4, 2048, 0)
        forward(loaded.model, [Segment(prompt, slab)], Floors())
        slabs.append(slab)
        nexts.append(forward(loaded.model, [Segment(token, loaded.copy_slab(slab), True)], Floors())[0])
    mx.eval(nexts, [[c.state for c in slab] for slab in slabs])
    assert {c.keys.dtype for c in slabs[0]} == {mx.float16} and {c.keys.dtype for c in slabs[1]} == {mx.float32}
    assert all(2 * k.nbytes == f.nbytes for k, f in zip(slabs[0], slabs[1], strict=True))
    for mine, theirs in ((0, 1), (1, 0)):
        loaded, own = models[mine], nexts[mine]
        taken = loaded.copy_slab(slabs[theirs])
        crossed = forward(loaded.model, [Segment(token, taken, True)], Floors())[0]
        assert {c.keys.dtype for c in taken} == {slabs[mine][0].keys.dtype}
        assert mx.argmax(crossed).item() == mx.argmax(own).item()
        assert mx.abs(crossed - own).max().item() < 1e-2 * mx.abs(own).max().item()


@pytest.mark.stack
def test_a_worker_without_the_kernel_serves_the_same_tokens(stack_factory, shared_stack, hf_tokenizer, near_tie):
    """`--cpu-kernel off` (what a worker does where the extension is not
    built): float32 copies on OpenBLAS's AVX2 kernels, whose rows depend on
    where they sit, so its default mode is near-tie, and it says all that;
    its greedy replies are the kernel worker's, or part at a near tie."""
    from kvmux.client import Client

    off = stack_factory(workers=1, slabs=2, worker_args=["--cpu-kernel", "off"], env={"OPENBLAS_CORETYPE": "Haswell"})
    compute = off.stats().workers[0].compute
    assert compute.kernel == "none (off)" and compute.blas == "OpenBLAS Haswell"
    assert compute.rows_alone and not compute.exact
    served = shared_stack.stats().workers[0].compute
    assert served.kernel == f"kvmux_native {native.isas()[0]}, {native.threads()} threads" and served.exact
    prompts = ["Name three rivers in Europe.", "Write a haiku about the sea.", "What is 12 times 12?"]
    replies = []
    for stack in (shared_stack, off):
        with Client(stack.frontend, timeout=300) as client:
            replies.append([])
            for prompt in prompts:
                with client.open_session() as session:
                    session.append(messages=[{"role": "user", "content": prompt}])
                    replies[-1].append(
                        [t for c in session.generate(max_tokens=32, temperature=0.0) for t in c.token_ids]
                    )
    for prompt, kernel, fallback in zip(prompts, *replies, strict=True):
        context = hf_tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        near_tie(context, kernel, fallback, exact=False)
    # mlx-lm's sampler there: a top-k past the vocabulary keeps every token
    # (mlx-lm's apply_top_k raises; the worker asks it for none).
    with Client(off.frontend, timeout=300) as client:
        sampled = []
        for top_k in (10**6, 0):
            with client.open_session() as session:
                session.append(messages=[{"role": "user", "content": prompts[0]}])
                stream = session.generate(max_tokens=12, temperature=1.0, top_k=top_k, seed=5)
                sampled.append([t for c in stream for t in c.token_ids])
        assert len(sampled[0]) > 0 and sampled[0] == sampled[1]


@pytest.mark.stack
def test_a_worker_on_the_int8_products_says_so_and_keeps_a_sessions_tokens_in_shared_passes(stack_factory):
    """`--cpu-products int8`: Compute names them; sessions decoding together
    (one pass a step) get the tokens each gets decoding alone: x's
    quantization is per row. Each prompt is prefilled alone first, so the
    two sides' slabs hold the same keys and values."""
    from concurrent.futures import ThreadPoolExecutor
    from contextlib import ExitStack

    from kvmux.client import Client

    stack = stack_factory(workers=1, slabs=4, worker_args=["--cpu-products", "int8"])
    compute = stack.stats().workers[0].compute
    assert compute.kernel == f"kvmux_native {native.isas()[0]}, {native.threads()} threads, int8 products"
    prompts = ["Why is the sky blue?", "Name three fruits.", "What is 12 times 12?", "Describe a cat in one line."]

    def replies(client, together):
        with ExitStack() as opened:
            sessions = [opened.enter_context(client.open_session()) for _ in prompts]
            for session, prompt in zip(sessions, prompts, strict=True):
                session.append(messages=[{"role": "user", "content": prompt}])

            def reply(session):
                return [t for c in session.generate(max_tokens=12, temperature=0.0) for t in c.token_ids]

            if not together:
                return [reply(session) for session in sessions]
            with ThreadPoolExecutor(len(sessions)) as pool:
                return list(pool.map(reply, sessions))

    with Client(stack.frontend, timeout=300) as client:
        alone, together = replies(client, False), replies(client, True)
    assert all(len(tokens) == 12 for tokens in alone)
    assert together == alone
