"""SCAPE's payload exchange with the values in 16 bits (`payload_dtype`).

The fp32 exchange (`_exchange.exchange_payload`) `pmean`s one buffer of every
leaf's values. Here the compressed leaves' values go through
`comm.payload.owner_mean` in bfloat16 or float16, with every rounding fed
back into the worker's residual; the leaves that are never compressed (norm
scales, biases: they have no residual) keep an fp32 `pmean`.
`docs/design.md`, "Half-width wire".
"""

from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from scape_jax.comm import payload


def exchange_narrow(moment: Sequence[jax.Array], layouts: Sequence,
                    offsets: Sequence[Optional[jax.Array]],
                    axis_name: Optional[str], payload_dtype: str) -> tuple:
  """The payload exchange of one step with the values in `payload_dtype`.

  Args:
    moment: m~ per leaf (fp32, full shape).
    layouts: the `masks.LeafLayout` per leaf, None on uncompressed leaves.
    offsets: the gathered offsets int32[N, k] per sparse leaf; None on
      uncompressed leaves and on compressed leaves dense at this level
      (then every entry of the chunk is sent).
    axis_name: the data-parallel axis, or None.
    payload_dtype: 'bfloat16' or 'float16'.

  Returns:
    (means, errors) per leaf, in `_exchange_payload`'s layout: flat
    compacted values (N*k) on sparse leaves, the flat leaf otherwise.
    `errors` are the rounding errors in the same layout, None on
    uncompressed leaves.
  """
  rows = [_rows(mt, layout, o) for mt, layout, o in
          zip(moment, layouts, offsets) if layout is not None]
  dense = [mt.reshape(-1) for mt, layout in zip(moment, layouts)
           if layout is None]
  mean_rows, error_rows = [], []
  if rows:
    mean, error = payload.owner_mean(jnp.concatenate(rows, axis=1),
                                     axis_name, payload_dtype)
    widths = [r.shape[1] for r in rows]
    mean_rows, error_rows = _split(mean, widths), _split(error, widths)
  if dense:
    flat = jnp.concatenate(dense)
    flat = flat if axis_name is None else jax.lax.pmean(flat, axis_name)
    dense = _split(flat, [x.size for x in dense])
  means, errors = [], []
  for mt, layout, o in zip(moment, layouts, offsets):
    if layout is None:
      means.append(dense.pop(0))
      errors.append(None)
    else:
      m, e = mean_rows.pop(0), error_rows.pop(0)
      means.append(_flat(m, layout, o, mt.shape))
      errors.append(_flat(e, layout, o, mt.shape))
  return means, errors


def _rows(mt: jax.Array, layout, offsets) -> jax.Array:
  """float32[N, k] values of m~ at each chunk's offsets (all of it if None)."""
  chunks = layout.to_chunks(mt)
  if offsets is None:
    return chunks
  return jnp.take_along_axis(chunks, offsets, axis=1)


def _flat(rows: jax.Array, layout, offsets, shape) -> jax.Array:
  """[N, k] rows back to `_exchange_payload`'s flat layout."""
  if offsets is None:
    return layout.from_chunks(rows, shape).reshape(-1)
  return rows.reshape(-1)


def _split(x: jax.Array, widths: Sequence[int]) -> list:
  """Consecutive slices of `x` along its last axis."""
  bounds = np.cumsum([0] + list(widths))
  return [x[..., a:b] for a, b in zip(bounds[:-1], bounds[1:])]
