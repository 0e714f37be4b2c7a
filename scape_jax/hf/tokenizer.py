"""Tokenizer files that `transformers.AutoTokenizer` loads.

A run's tokenizer is either the byte tokenizer (ids 0..255 are the UTF-8
bytes) or a `tokenizers` file (tokenizer.json). The byte tokenizer is written
as a byte-level BPE with no merges: GPT-2's byte-to-character table maps each
byte to one vocabulary entry whose id is the byte, so encoding any text gives
exactly its UTF-8 bytes, and decoding inverts it.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Optional

TOKENIZER_FILE = 'tokenizer.json'
TOKENIZER_CONFIG_FILE = 'tokenizer_config.json'
SPECIAL_TOKENS_FILE = 'special_tokens_map.json'


def bytes_to_unicode() -> dict[int, str]:
  """GPT-2's reversible byte -> printable character table."""
  printable = (list(range(ord('!'), ord('~') + 1)) +
               list(range(ord('¡'), ord('¬') + 1)) +
               list(range(ord('®'), ord('ÿ') + 1)))
  chars, extra = {}, 0
  for b in range(256):
    if b in printable:
      chars[b] = chr(b)
    else:
      chars[b] = chr(256 + extra)
      extra += 1
  return chars


def byte_tokenizer():
  """A `tokenizers.Tokenizer` whose ids are the UTF-8 bytes of the text."""
  import tokenizers  # pylint: disable=g-import-not-at-top
  from tokenizers import decoders, models, pre_tokenizers  # pylint: disable=g-import-not-at-top
  vocab = {c: b for b, c in bytes_to_unicode().items()}
  tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                               use_regex=False)
  tok.decoder = decoders.ByteLevel()
  return tok


def save_tokenizer(directory: str, spec: str, *, max_len: int,
                   eos_token: Optional[str] = None) -> list[str]:
  """Writes the tokenizer files of a run's `data.tokenizer` to `directory`.

  Args:
    directory: the output directory (created if needed).
    spec: 'byte' or the path of a tokenizer.json, as in the run's config.
    max_len: the model's context length (`model_max_length`).
    eos_token: the end-of-document token, if the tokenizer has one.

  Returns:
    The file names written.
  """
  os.makedirs(directory, exist_ok=True)
  out = os.path.join(directory, TOKENIZER_FILE)
  if spec == 'byte':
    byte_tokenizer().save(out)
  elif os.path.isfile(spec):
    shutil.copyfile(spec, out)
  else:
    raise FileNotFoundError(f'the run\'s tokenizer {spec!r} is neither '
                            "'byte' nor an existing tokenizer.json")
  special: dict[str, Any] = {}
  if eos_token is not None:
    special = {'eos_token': eos_token, 'bos_token': eos_token}
  config = {'tokenizer_class': 'PreTrainedTokenizerFast',
            'model_max_length': max_len, 'clean_up_tokenization_spaces': False,
            'add_bos_token': False, 'add_eos_token': False, **special}
  for name, content in ((TOKENIZER_CONFIG_FILE, config),
                        (SPECIAL_TOKENS_FILE, special)):
    with open(os.path.join(directory, name), 'w', encoding='utf-8') as f:
      json.dump(content, f, indent=2)
      f.write('\n')
  return [TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, SPECIAL_TOKENS_FILE]
