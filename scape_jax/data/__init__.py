"""Data: tokenizers, corpus preparation and the grain input pipeline.

Exports are loaded lazily so that `python -m scape_jax.data.prepare` does not
import grain, nor its own module twice. The `prepare` function is not
re-exported (the submodule has that name): use `scape_jax.data.prepare.prepare`.
"""

import importlib
from typing import Any

_EXPORTS = {
    'ByteTokenizer': 'tokenizer',
    'HFTokenizer': 'tokenizer',
    'get_tokenizer': 'tokenizer',
    'CorpusError': 'prepare',
    'load_meta': 'prepare',
    'load_split': 'prepare',
    'make_synthetic_corpus': 'prepare',
    'TrainIterator': 'pipeline',
    'train_iterator': 'pipeline',
    'eval_batches': 'pipeline',
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
  if name not in _EXPORTS:
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
  return getattr(importlib.import_module(f'{__name__}.{_EXPORTS[name]}'), name)
