"""Grain input pipeline over a prepared (memory-mapped) token corpus.

Training examples are windows of `seq_len + 1` tokens starting at
`offset_e + k * seq_len` (inputs are the first `seq_len` tokens, targets the
last `seq_len`), so within an epoch every token is a target at most once. Epoch
`e` visits the windows in a seeded pseudo-random order (`index_shuffle`, O(1)
memory) with its own seeded offset; epochs repeat forever.

Global example `g` belongs to global batch `g // global_batch_size`; process `p`
reads only its contiguous slice of each global batch, so concatenating the
slices of all processes in order gives the single-process batch, and the
iterator state (the next global batch index) is the same on every process.
"""

from __future__ import annotations

import functools
from typing import Any

import grain
from grain.experimental import index_shuffle
import numpy as np

from scape_jax.data import prepare as prepare_lib

Batch = dict[str, np.ndarray]
_STATE_VERSION = 1
# Fingerprint keys added after version 1: a state saved without one is not
# compared on it.
_ADDED_KEYS = ('val_sha256',)
_SHUFFLE_ROUNDS = 4


def _local_batch_size(
    batch_size: int, process_index: int, process_count: int
) -> int:
  if process_count < 1 or not 0 <= process_index < process_count:
    raise ValueError(
        f'need 0 <= process_index < process_count, got process_index='
        f'{process_index}, process_count={process_count}'
    )
  if batch_size < 1 or batch_size % process_count:
    raise ValueError(
        f'global batch size {batch_size} is not divisible by the process '
        f'count {process_count}'
    )
  return batch_size // process_count


def _to_batch(windows: np.ndarray) -> Batch:
  windows = windows.astype(np.int32)
  return {'inputs': windows[:, :-1], 'targets': windows[:, 1:]}


class _WindowSampler:
  """Maps a batch index to this process's token windows (pure, thread-safe)."""

  def __init__(
      self,
      tokens: np.ndarray,
      *,
      seq_len: int,
      global_batch_size: int,
      seed: int,
      process_index: int,
      local_batch_size: int,
  ):
    num_tokens = len(tokens)
    if num_tokens < seq_len + 1:
      raise ValueError(
          f'training split has {num_tokens} tokens, fewer than one window of '
          f'seq_len + 1 = {seq_len + 1}'
      )
    self.tokens = tokens
    self.seq_len = seq_len
    self.seed = seed
    # Windows per epoch, such that any offset in [0, max_offset] fits them.
    self.windows_per_epoch = max(1, (num_tokens - seq_len) // seq_len)
    if self.windows_per_epoch < global_batch_size:
      raise ValueError(
          f'training split has {num_tokens} tokens = '
          f'{self.windows_per_epoch} window(s) of seq_len + 1 = '
          f'{seq_len + 1} per epoch, fewer than one batch of '
          f'{global_batch_size}: every batch would repeat windows; use a '
          'larger corpus, or a smaller batch or seq_len'
      )
    self.max_offset = min(
        seq_len - 1, num_tokens - 1 - self.windows_per_epoch * seq_len
    )
    self._first = process_index * local_batch_size
    self._global = global_batch_size
    self._local = local_batch_size

  @functools.lru_cache(maxsize=16)
  def _epoch_params(self, epoch: int) -> tuple[int, int]:
    shuffle_seed, offset = np.random.SeedSequence(
        [self.seed, epoch]
    ).generate_state(2)
    return int(shuffle_seed), int(offset) % (self.max_offset + 1)

  def window_starts(self, batch_index: int) -> np.ndarray:
    n = self.windows_per_epoch
    starts = np.empty((self._local,), np.int64)
    for j in range(self._local):
      epoch, k = divmod(batch_index * self._global + self._first + j, n)
      shuffle_seed, offset = self._epoch_params(epoch)
      perm = index_shuffle(
          k, max_index=n - 1, seed=shuffle_seed, rounds=_SHUFFLE_ROUNDS
      )
      starts[j] = offset + perm * self.seq_len
    return starts

  def __call__(self, batch_index: int) -> Batch:
    starts = self.window_starts(batch_index)
    return _to_batch(self.tokens[starts[:, None] + np.arange(self.seq_len + 1)])


class TrainIterator:
  """Infinite iterator of local training batches with exact, JSON-able state."""

  def __init__(
      self,
      sampler: _WindowSampler,
      *,
      global_batch_size: int,
      data_sha256: str | None,
      val_sha256: str | None = None,
      num_threads: int = 2,
      prefetch: int = 4,
  ):
    self._sampler = sampler
    self._fingerprint = {
        'seed': sampler.seed,
        'seq_len': sampler.seq_len,
        'global_batch_size': global_batch_size,
        'data_sha256': data_sha256,
        # The eval batches' split: an edited one would make eval losses
        # before and after a resume incomparable.
        'val_sha256': val_sha256,
    }
    # One element per global batch index; far more batches than any run needs.
    ds = grain.MapDataset.range(2**62).map(sampler)
    self._iter = iter(
        ds.to_iter_dataset(
            grain.ReadOptions(
                num_threads=num_threads, prefetch_buffer_size=prefetch
            )
        )
    )

  @property
  def windows_per_epoch(self) -> int:
    return self._sampler.windows_per_epoch

  def __iter__(self) -> TrainIterator:
    return self

  def __next__(self) -> Batch:
    return next(self._iter)

  def get_state(self) -> dict[str, Any]:
    """Small JSON-serializable state; the same on every process."""
    return {
        'version': _STATE_VERSION,
        'next_batch': int(self._iter.get_state()['next_index']),
        **self._fingerprint,
    }

  def set_state(self, state: dict[str, Any]) -> None:
    """Restores a `get_state()`: next comes the batch that came next then."""
    if state.get('version') != _STATE_VERSION:
      raise ValueError(
          f"unsupported data iterator state version {state.get('version')!r}"
      )
    diff = {
        k: (state.get(k), v)
        for k, v in self._fingerprint.items()
        if state.get(k) != v and (k in state or k not in _ADDED_KEYS)
    }
    if diff:
      raise ValueError(
          'data iterator state was saved with a different configuration '
          f'(saved, current): {diff}'
      )
    self._iter.set_state({'next_index': int(state['next_batch'])})

  def close(self) -> None:
    close = getattr(self._iter, 'close', None)
    if close is not None:
      close()


def train_iterator(
    data_dir: str,
    *,
    seq_len: int,
    global_batch_size: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
) -> TrainIterator:
  """Returns an infinite, deterministic iterator of this process's batches.

  Each batch is `{'inputs', 'targets'}`, both int32[global_batch_size //
  process_count, seq_len], with `targets` the inputs shifted left by one token.
  """
  local = _local_batch_size(global_batch_size, process_index, process_count)
  if seq_len < 1:
    raise ValueError(f'seq_len must be positive, got {seq_len}')
  if not 0 <= seed < 2**63:
    raise ValueError(f'seed must be a non-negative integer, got {seed}')
  tokens = prepare_lib.load_split(data_dir, 'train')
  meta = prepare_lib.load_meta(data_dir)
  sampler = _WindowSampler(
      tokens,
      seq_len=seq_len,
      global_batch_size=global_batch_size,
      seed=seed,
      process_index=process_index,
      local_batch_size=local,
  )
  return TrainIterator(
      sampler,
      global_batch_size=global_batch_size,
      data_sha256=meta['sha256'].get('train.bin'),
      val_sha256=meta['sha256'].get('val.bin'),
  )


def eval_batches(
    data_dir: str,
    *,
    seq_len: int,
    batch_size: int,
    num_batches: int | None,
    process_index: int = 0,
    process_count: int = 1,
) -> list[Batch]:
  """Fixed validation batches: consecutive windows of val.bin, from its start.

  `batch_size` is global; each process gets its contiguous slice, as in
  training. `num_batches=None` takes as many full batches as val.bin holds.
  """
  local = _local_batch_size(batch_size, process_index, process_count)
  tokens = prepare_lib.load_split(data_dir, 'val')
  available = max(0, (len(tokens) - 1) // seq_len)
  needed_batches = (
      available // batch_size if num_batches is None else num_batches
  )
  if needed_batches < 1 or needed_batches * batch_size > available:
    raise ValueError(
        f'val.bin in {data_dir!r} has {len(tokens)} tokens = {available} '
        f'windows of seq_len {seq_len} (+1), not enough for '
        f'{num_batches or 1} batch(es) of {batch_size} (the training batch '
        'size); use fewer eval batches (eval_batches), a smaller batch or '
        'seq_len, or prepare a larger validation split (--val-fraction)'
    )
  offsets = np.arange(seq_len + 1)
  batches = []
  for b in range(needed_batches):
    first = b * batch_size + process_index * local
    starts = (first + np.arange(local)) * seq_len
    batches.append(_to_batch(np.asarray(tokens[starts[:, None] + offsets])))
  return batches
