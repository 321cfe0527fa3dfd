"""The projections' matmul: operands in the compute dtype, accumulated in float32.

`matmul(a, b)` is `a @ b` with `preferred_element_type=float32`, cast to `out_dtype`
(default: a's dtype). For float32 operands it is the plain dot, bit for bit. For bfloat16
operands it is the mixed-precision dot that TPU's MXU and GPU tensor cores run anyway,
and on XLA:CPU it is what selects the fast kernel: for a bfloat16 x bfloat16 dot with a
bfloat16 result XLA:CPU converts the operands to float32 at every call and runs a float32
dot, while the same dot with a float32 result runs on the CPU's bfloat16 kernel (as long
as its operands are row-major: `tpu_jobs.generate.decode_layouts` builds its activations
so). Measured on a 2-core Xeon (AMX, AVX512-BF16), JAX 0.10.2, the 100m preset's
projections as the feature-major decode step holds them (24 x [4096, 768] against 8 / 64
rows): 114 / 169 ms with a bfloat16 result, 7.7 / 26.6 ms with a float32 one (float32
operands: 17 / 46 ms).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def matmul(a: jax.Array, b: jax.Array, out_dtype: jnp.dtype | None = None) -> jax.Array:
    """a @ b (numpy's matmul broadcasting), accumulated in float32, cast to `out_dtype`
    (None: a's dtype)."""
    out = jnp.matmul(a, b, preferred_element_type=jnp.float32)
    return out.astype(a.dtype if out_dtype is None else out_dtype)


def matmul_t(a: jax.Array, b: jax.Array, out_dtype: jnp.dtype | None = None) -> jax.Array:
    """a @ b.T for 2-D a [m, k] and b [n, k], as `matmul` (float32 accumulation, cast to
    `out_dtype`, default a's dtype), without materialising b's transpose."""
    dims = (((1,), (1,)), ((), ()))
    out = jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)
    return out.astype(a.dtype if out_dtype is None else out_dtype)
