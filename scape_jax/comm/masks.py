"""Partitioned top-k masks: chunk layout, selection and wire encodings.

A compressed leaf of `size` elements is flattened row-major, padded to a
multiple of N (the number of data-parallel workers) and split into N
contiguous chunks of `c = ceil(size / N)` elements. Worker n owns chunk n and
selects the top-k entries of |m~| inside it. A chunk mask is kept as a bitmap
of `c` bits packed into little-endian uint32 words; on the wire it is sent
as that bitmap, as `k` int32 offsets within the chunk, or as `k` 16-bit
offsets plus a small table of sub-block ends ('indices16'), whichever the
request allows and is smallest (`docs/design.md`, "Wire" and "Half-width
wire").

All of this is pure jnp. The fast top-k selection is `comm.topk`; the
Pallas kernels for packing and selection are in `scape_jax.kernels`.
"""

import dataclasses
import fractions
import math
import numbers
from typing import Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from scape_jax.kernels.topk_mask import PAD_KEY, as_float_key, magnitude_key

ENCODINGS = ('auto', 'bitmap', 'indices')
OFFSET_BITS = ('auto', 32, 16)
# Entries one 16-bit offset addresses: a chunk is cut into sub-blocks of this
# many entries, and 'indices16' sends where each sub-block's offsets end.
SUB_BLOCK = 1 << 16
# Largest padded leaf: flat offsets, and a chunk's rows rounded up to whole
# Pallas blocks of 4096 entries, stay int32.
MAX_PADDED = 2**31 - 4096
_INDEX_WIDTHS = {32: ('indices',), 16: ('indices16',),
                 'auto': ('indices', 'indices16')}


def check_wire_request(mask_encoding: str, offset_bits):
  """`offset_bits` as one of `OFFSET_BITS` ('32' and '16' become ints).

  Raises:
    ValueError naming a bad `mask_encoding` or `offset_bits`.
  """
  if mask_encoding not in ENCODINGS:
    raise ValueError(f'scape: mask_encoding={mask_encoding!r}; allowed: '
                     f'{ENCODINGS}.')
  bits = {str(b): b for b in OFFSET_BITS}.get(offset_bits, offset_bits)
  if isinstance(bits, bool) or bits not in OFFSET_BITS:
    raise ValueError(f'scape: offset_bits={offset_bits!r}; allowed: '
                     f"{OFFSET_BITS} (or '32', '16').")
  return bits


def exact_decimal(x) -> fractions.Fraction:
  """The decimal a float was written as, exactly: 0.1 is 1/10, not the
  binary double nearest it, and a NumPy scalar reads as the shortest decimal
  of its own precision (np.float32(0.1) is 1/10 too, not the float32 value
  widened to a double, 0.10000000149...)."""
  if isinstance(x, np.floating):
    return fractions.Fraction(str(x))
  return fractions.Fraction(repr(float(x)))


def chunk_k(density: float, chunk: int) -> int:
  """k = ceil(density * chunk), computed exactly on the decimal `density`."""
  if (isinstance(density, bool) or not isinstance(density, numbers.Real)
      or not 0.0 < density <= 1.0):
    raise ValueError(f'density={density!r} must be a number in (0, 1].')
  k = math.ceil(exact_decimal(density) * chunk)
  return max(1, min(chunk, k))


@dataclasses.dataclass(frozen=True)
class LeafLayout:
  """Static chunk layout of one compressed leaf over N workers."""
  size: int  # real elements
  num_chunks: int  # N
  chunk_size: int  # c: elements per chunk, padding included

  @classmethod
  def create(cls, size: int, num_chunks: int,
             shape: tuple = ()) -> 'LeafLayout':
    """The layout of `size` elements (a leaf of `shape`, for errors)."""
    layout = cls(size=size, num_chunks=num_chunks,
                 chunk_size=-(-size // num_chunks))
    if layout.padded > MAX_PADDED:
      raise ValueError(
          f'scape: a leaf of shape {shape} ({size} elements, {layout.padded} '
          f'padded over {num_chunks} workers) is past the int32 indexing of '
          'the chunk masks (at most 2**31 - 4096 padded elements); mark it '
          'False in compress or split it.')
    return layout

  @property
  def padded(self) -> int:
    return self.chunk_size * self.num_chunks

  @property
  def words(self) -> int:
    """uint32 words of one packed chunk bitmap."""
    return -(-self.chunk_size // 32)

  @property
  def sub_blocks(self) -> int:
    """Sub-blocks of `SUB_BLOCK` entries a chunk spans (16-bit offsets)."""
    return -(-self.chunk_size // SUB_BLOCK)

  def wire_words(self, k: int, encoding: str) -> int:
    """32-bit words of one chunk mask sent in a resolved `encoding`."""
    if encoding == 'bitmap':
      return self.words
    if encoding == 'indices':
      return k
    return -(-k // 2) + self.sub_blocks - 1  # 'indices16'

  def encoding(self, k: int, requested: str, offset_bits=32) -> str:
    """The wire encoding of this leaf's chunk masks at k entries per chunk.

    'bitmap', 'indices' (int32 offsets) or 'indices16': among those that
    `requested` and `offset_bits` allow, the one of fewest words, the first
    of that order on ties ('auto' with 32-bit offsets: offsets when
    k < ceil(c/32)).
    """
    widths = _INDEX_WIDTHS[offset_bits]
    allowed = {'bitmap': ('bitmap',), 'indices': widths,
               'auto': ('bitmap',) + widths}[requested]
    return min(allowed, key=lambda e: self.wire_words(k, e))

  def mask_words(self, k: int, requested: str, offset_bits=32) -> int:
    """32-bit words one worker contributes to the mask all-gather."""
    return self.wire_words(k, self.encoding(k, requested, offset_bits))

  def num_valid(self, worker) -> jax.Array:
    """Real entries in chunk `worker` (may be traced); the rest is padding."""
    return jnp.clip(self.size - worker * self.chunk_size, 0, self.chunk_size)

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


def ones_words(c: int, leading: Tuple[int, ...] = ()) -> jax.Array:
  """`pack_bits` of `c` ones, uint32[*leading, ceil(c/32)], made on the host:
  a constant, not a reduction of constants, which XLA folds element by
  element (seconds per large leaf on a GPU)."""
  words = np.full(-(-c // 32), 0xFFFFFFFF, np.uint32)
  if c % 32:
    words[-1] = (1 << (c % 32)) - 1
  return jnp.asarray(np.broadcast_to(words, (*leading, words.size)))


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
  starts = own_zeros((n, k + 1), jnp.int32, before).at[
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
  offsets = word * 32 + position
  if not _STORE_OFFSETS:
    return offsets
  # Divided by a 1 that XLA cannot fold (no word has more than 32 set bits):
  # a division is costly enough that XLA stores the offsets once, where it
  # would otherwise redo this decode inside each consumer that can fuse it
  # (SCAPE's payload gather beside its scatters' index), and a stored
  # int32[n, k] costs less than a second decode (docs/design.md, "What
  # was tried").
  one = jnp.where(jax.lax.population_count(words[:, :1]) > 32, 2, 1)
  return jax.lax.div(offsets, one.astype(jnp.int32))


# False: `words_to_offsets` leaves XLA free to redo the decode in each
# consumer, as before it stored them (read when traced; docs/design.md,
# "What was tried").
_STORE_OFFSETS = True

def words_to_offsets_many(parts: Sequence[jax.Array],
                          ks: Sequence[int]) -> list:
  """`words_to_offsets` of many leaves: uint32[n_j, w_j] bitmaps with k_j
  set bits per row -> int32[n_j, k_j] each. Leaves of one (w, k) are
  decoded together, their rows stacked (the rows are independent: the same
  offsets), so that the program holds one decode per group of leaves, not
  per leaf."""
  return _rows_stacked(lambda words, key: words_to_offsets(words, key[1]),
                       parts, [(p.shape[1], int(k)) for p, k in zip(parts, ks)])


def offsets_to_words_many(offsets: Sequence[jax.Array],
                          cs: Sequence[int]) -> list:
  """`offsets_to_words` of many leaves: int32[n_j, k_j] offsets < c_j ->
  uint32[n_j, ceil(c_j/32)] each, the leaves of one (k, c) together."""
  return _rows_stacked(lambda o, key: offsets_to_words(o, key[1]), offsets,
                       [(o.shape[1], int(c)) for o, c in zip(offsets, cs)])


def equal_groups(keys: Sequence) -> list:
  """The indices of equal `keys`, grouped, in order of first appearance."""
  groups = {}
  for i, key in enumerate(keys):
    groups.setdefault(key, []).append(i)
  return list(groups.values())


def _rows_stacked(fn, arrays: Sequence[jax.Array], keys: Sequence) -> list:
  """`fn(rows, key)` once per group of equal `keys`, on the group's arrays
  with their rows stacked; each array's own rows of the result."""
  out = [None] * len(arrays)
  for members in equal_groups(keys):
    result = fn(jnp.concatenate([arrays[j] for j in members]),
                keys[members[0]])
    first = 0
    for j in members:
      rows = arrays[j].shape[0]
      out[j] = result[first:first + rows]
      first += rows
  return out


def repeat_last(offsets: jax.Array, k) -> jax.Array:
  """int32[..., K] rows whose first k (1 <= k <= K, may be traced) slots are
  a mask's offsets -> the rows with every slot past k holding the k-th
  offset. A payload gathered at them repeats that entry, its mean repeats
  the mean, and a scatter writes it twice: the same values as k slots, in a
  buffer sized for K (`scale_by_scape`'s `density_level=(first, last)`)."""
  slot = jnp.arange(offsets.shape[-1], dtype=jnp.int32)
  index = jnp.broadcast_to(jnp.minimum(slot, k - 1), offsets.shape)
  return jnp.take_along_axis(offsets, index, axis=-1)


def offsets_to_words(offsets: jax.Array, c: int) -> jax.Array:
  """int32[n, k] distinct offsets < c -> uint32[n, ceil(c/32)] bitmaps."""
  n = offsets.shape[0]
  rows = jnp.arange(n)[:, None]
  bit = jnp.uint32(1) << (offsets % 32).astype(jnp.uint32)
  # Distinct offsets set distinct bits, so adding them is OR-ing them.
  return own_zeros((n, -(-c // 32)), jnp.uint32, offsets).at[
      rows, offsets // 32].add(bit)


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


# ----------------------------------------------------------------------------
# The chunk mask on the wire, in a resolved encoding (`LeafLayout.encoding`).


def mask_to_wire(own: jax.Array, layout: LeafLayout, k: int,
                 encoding: str) -> jax.Array:
  """One worker's packed chunk bitmap -> the uint32 words it sends."""
  return masks_to_wire_many([own], [layout], [k], [encoding])[0]


def masks_to_wire_many(owns: Sequence[jax.Array],
                       layouts: Sequence[LeafLayout], ks: Sequence[int],
                       encodings: Sequence[str], live=None) -> list:
  """`mask_to_wire` of many leaves: the offsets of those sent as offsets
  are decoded together per group of one (w, k) (`words_to_offsets_many`).
  `live`: per leaf, the mask's own number of set bits (traced) where it is
  below k; the offsets past it repeat its last (`repeat_last`)."""
  index = [j for j, e in enumerate(encodings) if e != 'bitmap']
  offsets = dict(zip(index, words_to_offsets_many(
      [owns[j][None] for j in index], [ks[j] for j in index])))
  if live is not None:
    offsets = {j: repeat_last(o, live[j]) for j, o in offsets.items()}
  out = []
  for j, (own, layout, encoding) in enumerate(zip(owns, layouts, encodings)):
    if encoding == 'bitmap':
      out.append(own)
    elif encoding == 'indices':
      out.append(jax.lax.bitcast_convert_type(offsets[j][0], jnp.uint32))
    else:
      out.append(offsets_to_wire16(offsets[j][0], layout.chunk_size))
  return out


def offsets_from_wire(part: jax.Array, layout: LeafLayout, k: int,
                      encoding: str) -> jax.Array:
  """Gathered words uint32[N, w] -> ascending offsets int32[N, k] per chunk."""
  if encoding == 'bitmap':
    return words_to_offsets(part, k)
  if encoding == 'indices':
    return jax.lax.bitcast_convert_type(part, jnp.int32)
  return offsets_from_wire16(part, k, layout.chunk_size)


def offsets_to_wire16(offsets: jax.Array, chunk: int) -> jax.Array:
  """Ascending offsets int32[k] in a chunk of `chunk` -> uint32 words.

  The low 16 bits of each offset, two per word (the last half-word zero when
  k is odd), then, when the chunk spans B > 1 sub-blocks of `SUB_BLOCK`
  entries, B - 1 words: how many offsets fall below the end of sub-block b.
  Those ends give back the high bits, since the offsets are ascending. The
  layout is static: ceil(k/2) + B - 1 words.
  """
  k = offsets.shape[-1]
  low = (offsets & 0xFFFF).astype(jnp.uint32)
  low = jnp.pad(low, (0, -k % 2)).reshape(-1, 2)
  words = low[:, 0] | (low[:, 1] << 16)
  blocks = -(-chunk // SUB_BLOCK)
  if blocks == 1:
    return words
  bounds = jnp.arange(1, blocks, dtype=jnp.int32) * SUB_BLOCK
  ends = jnp.searchsorted(offsets, bounds, side='left')
  return jnp.concatenate([words, ends.astype(jnp.uint32)])


def offsets_from_wire16(words: jax.Array, k: int, chunk: int) -> jax.Array:
  """uint32[N, ceil(k/2) + B - 1] -> int32[N, k]: `offsets_to_wire16`^-1."""
  half = -(-k // 2)
  packed = words[:, :half]
  low = jnp.stack([packed & 0xFFFF, packed >> 16], axis=-1)
  low = low.reshape(words.shape[0], 2 * half)[:, :k].astype(jnp.int32)
  if -(-chunk // SUB_BLOCK) == 1:
    return low
  # high[i] = #{b : ends[b] <= i}: a running count of the ends' positions.
  ends = words[:, half:].astype(jnp.int32)
  rows = jnp.arange(words.shape[0])[:, None]
  marks = jnp.zeros((words.shape[0], k + 1), jnp.int32).at[rows, ends].add(1)
  high = jnp.cumsum(marks, axis=1)[:, :k]
  return high * SUB_BLOCK + low


def _flat_index(layout: LeafLayout, offsets: jax.Array) -> jax.Array:
  """Chunk offsets int32[N, k] -> flat offsets into the leaf, int32[N * k].

  Offsets into the padding past the leaf come out >= layout.size.
  """
  starts = jnp.arange(layout.num_chunks, dtype=jnp.int32)[:, None]
  return (starts * layout.chunk_size + offsets).reshape(-1)


def gather_at(x: jax.Array, layout: LeafLayout,
              offsets: jax.Array) -> jax.Array:
  """The N*k values of leaf x at chunk offsets int32[N, k], chunk by chunk
  (0 at padding)."""
  # Without padding every offset is in the leaf: no bounds to check.
  bounds = ({'mode': 'promise_in_bounds'} if layout.padded == layout.size
            else {'mode': 'fill', 'fill_value': 0.0})
  return x.reshape(-1).at[_flat_index(layout, offsets)].get(**bounds)


def set_at(x: jax.Array, layout: LeafLayout, offsets: jax.Array,
           values: jax.Array, after: Sequence[jax.Array] = ()) -> jax.Array:
  """Leaf x with the N*k entries at chunk offsets int32[N, k] replaced by
  `values` (those at padding dropped).

  `after`: the results of the other ops that read x. The scatter then
  follows them, so XLA writes into x's buffer instead of copying x first
  (it copies whenever another reader of x may still run after it).
  """
  values = following(values, after)
  # Without padding every offset is in the leaf: no bounds to check.
  mode = 'promise_in_bounds' if layout.padded == layout.size else 'drop'
  return x.reshape(-1).at[_flat_index(layout, offsets)].set(
      values, mode=mode).reshape(x.shape)


def following(x: jax.Array, deps: Sequence[jax.Array]) -> jax.Array:
  """x, made to depend on every array of `deps`: their first elements enter
  a condition that is never true (no 32-bit pattern has more than 32 bits
  set) but that XLA cannot fold, so an op reading the result runs after
  the ops producing `deps`. The values of x pass through unchanged."""
  never = None
  for d in deps:
    if d.size == 0:  # nothing to wait for
      continue
    first = d.reshape(-1)[0]
    if first.dtype.itemsize != 4:
      first = first.astype(jnp.float32)
    bits = jax.lax.population_count(
        jax.lax.bitcast_convert_type(first, jnp.uint32)) > 32
    never = bits if never is None else never | bits
  return x if never is None else jnp.where(never, jnp.ones_like(x), x)


def scatter_at(values: jax.Array, layout: LeafLayout, offsets: jax.Array,
               shape) -> jax.Array:
  """`gather_at`'s inverse: N*k values -> a full-shape leaf, 0 elsewhere."""
  return set_at(own_zeros(shape, values.dtype, offsets), layout, offsets,
                values)


def own_zeros(shape, dtype, *deps: jax.Array) -> jax.Array:
  """Zeros filled with a 0 computed from `deps` (`following`), which XLA
  cannot fold: a constant 0 array is shared by every array of one shape
  made from it, and copied before each scatter into it and into each
  output that is one."""
  return following(jnp.zeros(shape, dtype), deps)
