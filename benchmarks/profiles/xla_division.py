"""Is XLA's float32 division correctly rounded on this device?  Compares
``jaxattn.quant.reciprocal`` (which corrects the quotient exactly) and a plain
``lax.div(1, s)`` with numpy's IEEE division over 2^20 scales, and the
per-token int8 quantizer with numpy:

    python3 benchmarks/profiles/xla_division.py

On an H100 (jax 0.11.2): ``lax.div`` 142254 of 1048576 quotients one ulp
off, 22 of 1M int8 values flipped; on the CPU: none (docs/design.md).
"""
import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import int_flash, quant

rng = np.random.default_rng(0)
s = (np.abs(rng.standard_normal(1 << 20)).astype(np.float32)
     * np.float32(3 / 127) + np.float32(1e-3))
exact = (np.float32(1) / s).astype(np.float32)
print("quant.reciprocal vs numpy mismatches",
      int((np.asarray(jax.jit(quant.reciprocal)(s)) != exact).sum()), "of",
      s.size)
plain = jax.jit(lambda s: jax.lax.div(jnp.ones_like(s), s))(s)
print("lax.div(1, s) mismatches", int((np.asarray(plain) != exact).sum()))
x = rng.standard_normal((8192, 128)).astype(np.float16).astype(np.float32)
sc = np.abs(x).max(-1) * np.float32(1 / 127)
want = np.clip(np.rint(x * (np.float32(1) / sc)[:, None]), -127, 127)
got, got_sc = jax.jit(int_flash._per_token)(x)
print("per-token int8: scale mismatches", int((np.asarray(got_sc) != sc).sum()),
      "value mismatches", int((np.asarray(got) != want).sum()))
