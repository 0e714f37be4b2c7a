"""Partitioned top-k masks: chunk layout, selection and wire encodings.

A compressed leaf of `size` elements is flattened row-major, padded to a
multiple of N (the number of data-parallel workers) and split into N
contiguous chunks of `c = ceil(size / N)` elements. Worker n owns chunk n and
selects the top-k entries of |m~| inside it. A chunk mask is kept as a bitmap
of `c` bits packed into little-endian uint32 words; on the wire it is sent
either as that bitmap or as `k` int32 offsets within the chunk, whichever is
smaller (`docs/design.md` section 3).

All of this is pure jnp. The fast top-k selection is `comm.topk`; the
Pallas kernels for packing and selection are in `scape_jax.kernels`.
"""

import dataclasses
import fractions
import math
from typing import Tuple

import jax
import jax.numpy as jnp

from scape_jax.kernels.topk_mask import PAD_KEY, as_float_key, magnitude_key

ENCODINGS = ('auto', 'bitmap', 'indices')


def chunk_k(density: float, chunk: int) -> int:
  """k = ceil(density * chunk), computed exactly on the decimal `density`."""
  if not 0.0 < density <= 1.0:
    raise ValueError(f'density={density!r} must be in (0, 1].')
  k = math.ceil(fractions.Fraction(repr(float(density))) * chunk)
  return max(1, min(chunk, k))


@dataclasses.dataclass(frozen=True)
class LeafLayout:
  """Static chunk layout of one compressed leaf over N workers."""
  size: int  # real elements
  num_chunks: int  # N
  chunk_size: int  # c: elements per chunk, padding included

  @classmethod
  def create(cls, size: int, num_chunks: int) -> 'LeafLayout':
    return cls(size=size, num_chunks=num_chunks,
               chunk_size=-(-size // num_chunks))

  @property
  def padded(self) -> int:
    return self.chunk_size * self.num_chunks

  @property
  def words(self) -> int:
    """uint32 words of one packed chunk bitmap."""
    return -(-self.chunk_size // 32)

  def encoding(self, k: int, requested: str) -> str:
    """The wire encoding of this leaf's chunk masks at k entries per chunk."""
    if requested == 'auto':
      return 'indices' if k < self.words else 'bitmap'
    return requested

  def mask_words(self, k: int, requested: str) -> int:
    """32-bit words one worker contributes to the mask all-gather."""
    return k if self.encoding(k, requested) == 'indices' else self.words

  def to_chunks(self, x: jax.Array) -> jax.Array:
    """[*shape] -> [N, c], zero padded."""
    flat = x.reshape(-1)
    flat = jnp.pad(flat, (0, self.padded - self.size))
    return flat.reshape(self.num_chunks, self.chunk_size)

  def from_chunks(self, chunks: jax.Array, shape: Tuple[int, ...]) -> jax.Array:
    return chunks.reshape(-1)[:self.size].reshape(shape)


def pack_bits(bits: jax.Array) -> jax.Array:
  """bool[..., c] -> uint32[..., ceil(c/32)], bit j in word j//32, bit j%32."""
  c = bits.shape[-1]
  words = -(-c // 32)
  bits = jnp.pad(bits.astype(jnp.uint32),
                 [(0, 0)] * (bits.ndim - 1) + [(0, words * 32 - c)])
  bits = bits.reshape(*bits.shape[:-1], words, 32)
  shifts = jnp.arange(32, dtype=jnp.uint32)
  return jnp.sum(bits << shifts, axis=-1, dtype=jnp.uint32)


def unpack_bits(words: jax.Array, c: int) -> jax.Array:
  """uint32[..., w] -> bool[..., c], the inverse of `pack_bits`."""
  shifts = jnp.arange(32, dtype=jnp.uint32)
  bits = (words[..., None] >> shifts) & jnp.uint32(1)
  return bits.reshape(*words.shape[:-1], -1)[..., :c].astype(bool)


def bits_to_offsets(bits: jax.Array, k: int) -> jax.Array:
  """bool[..., c] with k set bits per row -> int32[..., k] ascending offsets."""
  flat = bits.reshape(-1, bits.shape[-1])
  offs = jax.vmap(lambda b: jnp.nonzero(b, size=k, fill_value=0)[0])(flat)
  return offs.astype(jnp.int32).reshape(*bits.shape[:-1], k)


def offsets_to_bits(offsets: jax.Array, c: int) -> jax.Array:
  """int32[..., k] -> bool[..., c]."""
  flat = offsets.reshape(-1, offsets.shape[-1])
  rows = jnp.arange(flat.shape[0])[:, None]
  bits = jnp.zeros((flat.shape[0], c), bool).at[rows, flat].set(True)
  return bits.reshape(*offsets.shape[:-1], c)


def words_to_offsets(words: jax.Array, k: int) -> jax.Array:
  """uint32[n, w] bitmaps with exactly k set bits per row -> int32[n, k]
  ascending offsets; `bits_to_offsets(unpack_bits(words, c), k)` without a
  pass over the c bits.

  The j-th set bit lies in the last word whose exclusive prefix popcount is
  <= j; its position inside that word is found by a 5-step binary search on
  popcounts. The work is O(w + k) per row, not O(c).
  """
  n, w = words.shape
  count = jax.lax.population_count(words).astype(jnp.int32)
  before = jnp.cumsum(count, axis=1) - count  # set bits in earlier words
  rows = jnp.arange(n)[:, None]
  starts = jnp.zeros((n, k + 1), jnp.int32).at[
      rows, jnp.minimum(before, k)].add(1)
  word = jnp.cumsum(starts[:, :k], axis=1) - 1  # word of the j-th set bit
  rank = jnp.arange(k, dtype=jnp.int32) - jnp.take_along_axis(before, word, 1)
  value = jnp.take_along_axis(words, word, 1)
  position = jnp.zeros((n, k), jnp.int32)
  for width in (16, 8, 4, 2, 1):
    low = jax.lax.population_count(
        value & jnp.uint32((1 << width) - 1)).astype(jnp.int32)
    up = rank >= low
    rank = jnp.where(up, rank - low, rank)
    value = jnp.where(up, value >> width, value)
    position = jnp.where(up, position + width, position)
  return word * 32 + position


def offsets_to_words(offsets: jax.Array, c: int) -> jax.Array:
  """int32[n, k] distinct offsets < c -> uint32[n, ceil(c/32)] bitmaps."""
  n = offsets.shape[0]
  rows = jnp.arange(n)[:, None]
  bit = jnp.uint32(1) << (offsets % 32).astype(jnp.uint32)
  # Distinct offsets set distinct bits, so adding them is OR-ing them.
  return jnp.zeros((n, -(-c // 32)), jnp.uint32).at[rows, offsets // 32].add(
      bit)


def chunk_topk_bits(scores: jax.Array, valid: jax.Array, width: int,
                    k: jax.Array) -> jax.Array:
  """The k entries of largest |scores| among `valid` positions, as bits.

  The sort-based reference of `comm.topk.chunk_topk_words`: entries are
  ranked by `kernels.topk_mask.magnitude_key` (|x|; every NaN above +-inf).

  Args:
    scores: float[c]; the magnitude is ranked.
    valid: bool[c], False at padding; padding is chosen only after every real
      position, so a chunk with fewer than k real entries fills up with it.
    width: static top-k width, >= every k this call may receive.
    k: int32 scalar (may be traced), 1 <= k <= width.

  Returns:
    bool[c] with exactly k set bits. Ties go to the lower offset.
  """
  c = scores.shape[-1]
  keys = jnp.where(valid, magnitude_key(scores), PAD_KEY)
  if width >= c:  # Dense: all positions in offset order of preference.
    order = jnp.argsort(-keys, stable=True)
  else:
    _, order = jax.lax.top_k(as_float_key(keys), width)
  keep = jnp.arange(order.shape[0]) < k
  return jnp.zeros((c,), bool).at[order].set(keep)
