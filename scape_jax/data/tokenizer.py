"""Tokenizers: a UTF-8 byte tokenizer and a wrapper around HF `tokenizers`."""

from __future__ import annotations

import hashlib
import os
from typing import Protocol, Sequence

import numpy as np

# Special tokens tried, in order, as the end-of-document id of an HF tokenizer.
EOS_CANDIDATES = (
    '<|endoftext|>',
    '<|end_of_text|>',
    '</s>',
    '<eos>',
    '<|eos|>',
    '[EOS]',
)


def token_dtype(vocab_size: int) -> np.dtype:
  """Smallest unsigned dtype used to store ids of a vocabulary this large."""
  return np.dtype(np.uint16 if vocab_size <= 65535 else np.uint32)


class Tokenizer(Protocol):
  """What `prepare` needs from a tokenizer."""

  spec: str
  vocab_size: int
  eos_id: int | None
  fingerprint: str | None

  def encode(self, text: str) -> np.ndarray:
    ...

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    ...


class ByteTokenizer:
  """Maps text to its UTF-8 bytes; vocabulary of 256, no special tokens."""

  spec = 'byte'
  vocab_size = 256
  eos_id = None
  fingerprint = None

  def encode(self, text: str) -> np.ndarray:
    return np.frombuffer(text.encode('utf-8'), dtype=np.uint8).astype(np.uint16)

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    arr = np.asarray(ids)
    if arr.size and (arr.min() < 0 or arr.max() > 255):
      raise ValueError(
          f'byte token ids must be in [0, 255], got [{arr.min()}, {arr.max()}]'
      )
    return arr.astype(np.uint8).tobytes().decode('utf-8', errors='replace')


class HFTokenizer:
  """A `tokenizers.Tokenizer` loaded from a tokenizer.json file."""

  def __init__(self, path: str):
    import tokenizers  # pylint: disable=g-import-not-at-top

    if not os.path.isfile(path):
      raise FileNotFoundError(f'tokenizer file not found: {path}')
    self.spec = path
    try:
      self._tok = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # pylint: disable=broad-except
      # tokenizers raises a bare Exception for a file it cannot parse.
      raise ValueError(f'{path!r} is not a tokenizers tokenizer.json: '
                       f'{e}') from None
    # Text that spells a special token ('<|endoftext|>' quoted in a
    # document) is text: only prepare's separators are special ids.
    self._tok.encode_special_tokens = True
    self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
    self.eos_id = next(
        (
            i
            for i in map(self._tok.token_to_id, EOS_CANDIDATES)
            if i is not None
        ),
        None,
    )
    self.fingerprint = fingerprint(path)
    self._dtype = token_dtype(self.vocab_size)

  def encode(self, text: str) -> np.ndarray:
    ids = self._tok.encode(text, add_special_tokens=False).ids
    return np.asarray(ids, dtype=self._dtype)

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def fingerprint(spec: str) -> str | None:
  """What a prepared corpus records of tokenizer `spec`: the sha256 of its
  tokenizer.json, None for 'byte'. Raises OSError for a missing file."""
  if spec == 'byte':
    return None
  with open(spec, 'rb') as f:
    return hashlib.sha256(f.read()).hexdigest()


def get_tokenizer(spec: str) -> Tokenizer:
  """Returns the tokenizer for `spec`: 'byte' or a path to a tokenizer.json."""
  if spec == 'byte':
    return ByteTokenizer()
  if spec.endswith('.json'):
    return HFTokenizer(spec)
  raise ValueError(
      f"unknown tokenizer spec {spec!r}: expected 'byte' or a path to a "
      'HuggingFace '
      "tokenizer file ending in '.json' (e.g. 'models/tokenizer.json')"
  )
