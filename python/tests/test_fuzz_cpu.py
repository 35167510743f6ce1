"""Argument fuzzing through the Python package, no GPU needed.

NumPy arrays are CPU arrays: every call must raise dsa_decode.InvalidArgument
naming one of the function's arguments in quotes ('name') - for the wrong
dtype, shape, strides or device - and never another exception type or a
crash. Each case starts from arrays of the valid shapes and mutates 1-3 of
them (dtype, a size, a transposed or sliced view, an empty array, a 0-d or
5-d array, a negative-stride view). Seeded: DSA_TEST_SEED repeats a run.
"""

import os
import random
import re

import numpy as np
import pytest

import dsa_decode

SEED = int(os.environ.get("DSA_TEST_SEED", random.randrange(1 << 32)))
CASES = 300  # per entry point

DTYPES = [np.float16, np.float32, np.int32, np.int64, np.uint8, np.int8, np.uint16, np.float64, np.bool_]


def base_head_gemv(r):
    m, h, i, j = r.randint(1, 16), r.choice([1, 8, 64]), 8 * r.randint(1, 16), r.choice([16, 128])
    return dict(x=((m, h, i), np.float16), weight=((h, i, j), np.float16), out=((m, h, j), np.float16))


def base_norm(r):
    m, kv = r.randint(1, 16), 8 * r.randint(1, 16)
    q = kv + 8 * r.randint(0, 16)
    return dict(qkv=((m, q + kv), np.float16), q_weight=((q,), np.float16), kv_weight=((kv,), np.float16),
                q_out=((m, q), np.float16), kv_out=((m, kv), np.float16))


def base_linear(r):
    m, k, n = r.randint(1, 8), 8 * r.randint(1, 64), r.randint(1, 512)
    return dict(x=((m, k), np.float16), weight=((n, k), np.float16), out=((m, n), np.float16))


def base_sparse(r):
    m, h, k = r.randint(1, 16), r.choice([8, 64]), r.choice([64, 2048])
    return dict(q=((m, h, 512), np.uint8), q_scale=((1,), np.float32), kv_cache=((4, 64, 512), np.uint8),
                k_scale=((1,), np.float32), indices=((m, k), np.int32), latent=((m, h, 512), np.float16),
                lse=((m, h), np.float32), split_counters=((m * h,), np.int32))


def base_rope(r):
    m, h, p = r.randint(1, 16), r.choice([16, 64, 128]), r.choice([128, 192])
    return dict(q_nope=((m, h, p), np.float16), q_pe=((m, h, 64), np.float16), k_pe=((m, 64), np.float16),
                positions=((m,), np.int64), cos_sin=((4096, 64), np.float32), weight=((h, p, 512), np.float16),
                out=((m, h, 576), np.float16), k_pe_out=((m, 64), np.float16))


def base_v32_write(r):
    m = r.randint(1, 16)
    return dict(kv_c=((m, 512), np.float16), k_pe=((m, 64), np.float16), slot_mapping=((m,), np.int64),
                kv_cache=((4, 64, 656), np.uint8))


def base_v32(r):
    m, h, k = r.randint(1, 16), r.choice([16, 128]), r.choice([64, 2048])
    return dict(q=((m, h, 576), np.float16), kv_cache=((4, 64, 656), np.uint8), indices=((m, k), np.int32),
                latent=((m, h, 512), np.float16), lse=((m, h), np.float32))


ENTRIES = {
    "rope_absorb": (base_rope, lambda a: dsa_decode.rope_absorb(
        a["q_nope"], a["q_pe"], a["k_pe"], a["positions"], a["cos_sin"], a["weight"], a["out"], a["k_pe_out"])),
    "sparse_mla_v32_cache_write": (base_v32_write, lambda a: dsa_decode.sparse_mla_v32_cache_write(
        a["kv_c"], a["k_pe"], a["slot_mapping"], a["kv_cache"])),
    "sparse_mla_v32": (base_v32, lambda a: dsa_decode.sparse_mla_v32(
        a["q"], a["kv_cache"], a["indices"], 0.1352338, a["latent"], a["lse"])),
    "head_gemv": (base_head_gemv, lambda a: dsa_decode.head_gemv(a["x"], a["weight"], a["out"])),
    "qkv_rmsnorm": (base_norm, lambda a: dsa_decode.qkv_rmsnorm(a["qkv"], a["q_weight"], a["kv_weight"], 1e-6,
                                                               a["q_out"], a["kv_out"])),
    "linear_gemv": (base_linear, lambda a: dsa_decode.linear_gemv(a["x"], a["weight"], a["out"])),
    "sparse_mla": (base_sparse, lambda a: dsa_decode.sparse_mla(
        a["q"], a["q_scale"], a["kv_cache"], a["k_scale"], a["indices"], 0.0625, a["latent"], a["lse"],
        a["split_counters"])),
}


def mutate(array, r):
    kind = r.randrange(8)
    if kind == 0:
        return array.astype(r.choice(DTYPES))
    if kind == 1 and array.ndim:
        shape = list(array.shape)
        shape[r.randrange(len(shape))] = r.choice([0, 1, 2, 3, shape[0] + 1])
        return np.zeros(shape, array.dtype)
    if kind == 2 and array.ndim >= 2:
        return np.swapaxes(array, 0, array.ndim - 1)
    if kind == 3 and array.ndim and array.shape[-1] > 1:
        return array[..., ::2]
    if kind == 4 and array.ndim and array.shape[0] > 1:
        return array[::-1]
    if kind == 5:
        return np.zeros((), array.dtype)
    if kind == 6:
        return np.zeros((1, 1, 1, 1, 1), array.dtype)
    return np.zeros((0,) + array.shape[1:], array.dtype)


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_numpy_arguments_raise_invalid_argument_naming_an_argument(entry):
    make, call = ENTRIES[entry]
    rng = random.Random(f"{SEED}-{entry}")
    for case in range(CASES):
        spec = make(rng)
        arrays = {name: np.zeros(shape, dtype) for name, (shape, dtype) in spec.items()}
        changed = []
        for _ in range(rng.randint(0, 3)):  # 0: the valid shapes, still CPU arrays
            name = rng.choice(sorted(arrays))
            arrays[name] = mutate(arrays[name], rng)
            changed.append(name)
        where = f"{entry} case {case} (DSA_TEST_SEED={SEED}), mutated {changed}"
        with pytest.raises(dsa_decode.InvalidArgument) as raised:
            call(arrays)
        named = re.findall(r"argument '([^']+)'", str(raised.value))
        assert named, f"{where}: no argument named in {raised.value}"
        assert any(n == a or n.startswith(a + ".") or n.startswith(a + " ") or f"({a}." in n
                   for n in named[:1] for a in list(arrays) + ["scale", "cache", "eps", "m", "q_size", "kv_size"]), \
            f"{where}: '{named[0]}' is not an argument of {entry}: {raised.value}"
