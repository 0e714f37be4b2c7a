"""Bytes one device sends in the standard ring collectives.

  all-reduce          2 (N-1)/N * S   (S = the reduced buffer)
  all-gather            (N-1)/N * S   (S = the gathered output buffer)
  reduce-scatter        (N-1)/N * S   (S = the input buffer)

The analytic side of the byte accounting: benchmarks put these figures beside
the ones read from compiled programs (`scape_jax.analysis.hlo`).
"""


def ring_all_reduce_bytes(nbytes: float, n: int) -> float:
  """Ring all-reduce of an `nbytes` buffer over `n` devices."""
  return 0.0 if n <= 1 else 2.0 * (n - 1) / n * nbytes


def ring_all_gather_bytes(full_nbytes: float, n: int) -> float:
  """Ring all-gather whose gathered (output) buffer is `full_nbytes`."""
  return 0.0 if n <= 1 else (n - 1) / n * full_nbytes


def ring_reduce_scatter_bytes(full_nbytes: float, n: int) -> float:
  """Ring reduce-scatter whose input buffer is `full_nbytes`."""
  return 0.0 if n <= 1 else (n - 1) / n * full_nbytes
