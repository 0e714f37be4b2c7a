"""A half-width payload exchange whose every rounding is fed back.

SCAPE's payload is, per compressed leaf, the values of each worker's m~ at
the mask, laid out chunk by chunk: row c holds the values at chunk c's
entries, and chunk c is owned by worker c. `owner_mean` averages such rows
over the workers with the values on the wire in 16 bits:

1. each worker rounds its rows to the wire dtype and keeps the rounding
   error (its error feedback, like the entries it did not send);
2. an all-to-all hands row c of every worker to worker c;
3. worker c sums the N rows it received in fp32, in worker order, divides
   by N and rounds the mean to the wire dtype; N times the error of that
   rounding is added to its own error at row c;
4. an all-gather of the rounded means gives every worker the same rows.

Bytes per worker: (N-1)/N S for the all-to-all plus (N-1)/N S for the
all-gather (S = the N rows in the wire dtype), i.e. a ring all-reduce of the
half-width buffer, but no value is ever summed in 16 bits and the mean every
worker applies is exactly the one that was rounded. Over the workers, the
errors kept add up to what the applied mean lacks: nothing is lost, only
delayed (`docs/design.md`, "Half-width wire").

Rounding is round-to-nearest-even with saturation at the dtype's largest
finite value (the excess is fed back too), done by `lax.reduce_precision` in
fp32 so that no compiler pass may elide it; the cast to the wire dtype that
follows is exact.
"""

from typing import Optional

import jax
import jax.numpy as jnp

from scape_jax.comm.collectives import all_gather_invariant

PAYLOAD_DTYPES = ('float32', 'bfloat16', 'float16')


def check_payload_dtype(payload_dtype: str) -> None:
  """Raises ValueError unless `payload_dtype` is one of `PAYLOAD_DTYPES`."""
  if payload_dtype not in PAYLOAD_DTYPES:
    raise ValueError(f'scape: payload_dtype={payload_dtype!r}; allowed: '
                     f'{PAYLOAD_DTYPES}.')


def round_to(x: jax.Array, dtype) -> jax.Array:
  """fp32 `x` rounded to the nearest value of `dtype` (ties to even), in fp32.

  Values beyond the dtype's largest finite value saturate at it. XLA's
  reduce-precision flushes values below the dtype's smallest normal to zero
  (only float16 has such values within the fp32 range that matters).
  """
  info = jnp.finfo(dtype)
  x = jnp.clip(x, -float(info.max), float(info.max))
  return jax.lax.reduce_precision(x, exponent_bits=info.nexp,
                                  mantissa_bits=info.nmant)


def owner_mean(rows: jax.Array, axis_name: Optional[str],
               payload_dtype: str) -> tuple:
  """The mean over workers of `rows`, sent in `payload_dtype`.

  Args:
    rows: float32[N, K], this worker's values; row c belongs to chunk c,
      whose owner is worker c (N = the size of `axis_name`, 1 without one).
    axis_name: the data-parallel axis, or None for a single worker.
    payload_dtype: 'bfloat16' or 'float16'.

  Returns:
    (mean, error): mean float32[N, K], the same on every worker (typed
    invariant); error float32[N, K], this worker's rounding errors, which
    the caller adds to its residual.
  """
  dtype = jnp.dtype(payload_dtype)
  n = rows.shape[0]
  sent = round_to(rows, dtype)
  error = rows - sent
  wire = _to_wire(sent, dtype)
  if axis_name is not None:
    wire = jax.lax.all_to_all(wire, axis_name, 0, 0, tiled=True)
  total = _from_wire(wire[0], dtype)
  for i in range(1, n):  # Worker order, so that the sum is reproducible.
    total = total + _from_wire(wire[i], dtype)
  mean = total / n
  kept = round_to(mean, dtype)
  own = 0 if axis_name is None else jax.lax.axis_index(axis_name)
  error = error.at[own].add((mean - kept) * n)
  kept = _to_wire(kept, dtype)
  kept = kept[None] if axis_name is None else all_gather_invariant(kept,
                                                                   axis_name)
  return _from_wire(kept, dtype), error


def _to_wire(x: jax.Array, dtype) -> jax.Array:
  """fp32 values exact in `dtype` -> their 16 bits as uint16.

  The collectives move uint16: XLA:CPU widens bfloat16 collectives to fp32
  (twice the bytes), integer ones it leaves alone.
  """
  return jax.lax.bitcast_convert_type(x.astype(dtype), jnp.uint16)


def _from_wire(x: jax.Array, dtype) -> jax.Array:
  return jax.lax.bitcast_convert_type(x, dtype).astype(jnp.float32)
