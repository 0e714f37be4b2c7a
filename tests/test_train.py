"""The trainer end to end on 8 simulated CPU devices with a generated corpus."""

import json
import os
import shutil

import jax
import numpy as np
import pytest
from jax.experimental import serialize_executable

import scape_jax
from scape_jax import analysis
from scape_jax.comm import masks
from scape_jax import train as trainer
from scape_jax.train import config as config_lib
from tests.tiny_runs import run_config


def _cfg(corpus, out_dir, *overrides):
  return run_config(corpus, out_dir, *overrides, eval_batches=2)


def _train_losses(out_dir):
  with open(os.path.join(out_dir, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f]
  return [r['loss'] for r in rows if r['split'] == 'train']


@pytest.mark.parametrize('preset', ['gpt-tiny', 'llama-tiny'])
def test_two_step_smoke_per_family(corpus, tmp_path, preset):
  cfg = _cfg(corpus, tmp_path, f'--config.model.preset={preset}',
             '--config.steps=2', '--config.eval_every=2')
  summary = trainer.train(cfg)
  assert len(summary['losses']) == 2
  assert all(np.isfinite(summary['losses']))
  assert np.isfinite(summary['eval_loss'])
  assert os.path.getsize(tmp_path / 'loss.png') > 0
  assert os.listdir(tmp_path / 'tb')


def test_local_adam_resume_is_bit_exact(corpus, tmp_path):
  """`scape_local_adam` stopped at step 3 and resumed: the same losses as
  the run that did not stop. (Algorithm 1's resume: test_compile_cache.py,
  test_offload.py and test_update_count.py.)"""
  args = ('--config.optimizer.name=scape', '--config.optimizer.scape.density=0.1',
          '--config.optimizer.scape.local_adam=true', '--config.eval_every=0')
  straight = trainer.train(_cfg(corpus, tmp_path / 'a', '--config.steps=6',
                                '--config.ckpt_every=3', *args))
  # Run b: run a's checkpoint of step 3 alone, as if it had stopped there.
  shutil.copytree(tmp_path / 'a' / 'ckpt', tmp_path / 'b' / 'ckpt')
  shutil.rmtree(tmp_path / 'b' / 'ckpt' / '6')
  resumed = trainer.train(_cfg(corpus, tmp_path / 'b', '--config.steps=6',
                               '--config.ckpt_every=3', *args))
  assert resumed['start_step'] == 3
  assert resumed['losses'] == straight['losses'][3:]  # bit for bit


def test_scape_trains_like_adams(corpus, tmp_path):
  """SCAPE at 10% density (with warmup) gets most of AdamS's progress.

  Outside the mask SCAPE moves a parameter only when it is selected, so over
  a short run it trails AdamS; docs/results.md has the longer comparison.
  Two density levels (1 and 0.1) compile three programs where the default
  eight compile nine (the ratio is 0.727 with two, 0.724 with eight).
  """
  drop = {}
  for name in ('adams', 'scape'):
    cfg = _cfg(corpus, tmp_path / name, '--config.steps=50',
               '--config.eval_every=0', f'--config.optimizer.name={name}',
               '--config.optimizer.scape.density=0.1',
               '--config.optimizer.scape.density_warmup_steps=20',
               '--config.optimizer.scape.density_levels=2')
    losses = trainer.train(cfg)['losses']
    drop[name] = losses[0] - np.mean(losses[-5:])
    assert np.mean(losses[-5:]) < 0.5 * losses[0], (name, losses)
  assert drop['scape'] >= 0.7 * drop['adams'], drop


def test_train_step_bytes_on_the_wire(corpus, tmp_path):
  """From the compiled train step: payload ~ selected values + dense leaves."""
  density, n = 0.01, 8
  cfg = _cfg(corpus, tmp_path, '--config.optimizer.name=scape',
             f'--config.optimizer.scape.density={density}', '--config.steps=10')
  program = trainer.build_program(cfg)
  cols = analysis.collectives_from_hlo(
      program.compile_step(5, run=False).as_text())
  leaves = jax.tree.leaves(program.abstract_params)
  selected, dense, words = 0, 0, 0
  for p in leaves:
    size = int(np.prod(p.shape))
    if len(p.shape) >= 2:
      lay = masks.LeafLayout.create(size, n)
      k = masks.chunk_k(density, lay.chunk_size)
      selected += n * k
      words += lay.mask_words(k, 'auto')
    else:
      dense += size
  reduced = sum(c.elements for c in cols if c.kind == 'all-reduce')
  assert selected + dense <= reduced <= 1.05 * (selected + dense)
  gathers = [c for c in cols if c.kind == 'all-gather']
  assert [c.elements for c in gathers] == [n * words]
  smallest = min(int(np.prod(p.shape)) for p in leaves if len(p.shape) >= 2)
  for c in cols:  # zero-filled leaf-sized buffers would be >= `smallest`
    if c.kind != 'all-reduce':
      assert c.elements < smallest
  assert reduced < 0.02 * sum(int(np.prod(p.shape)) for p in leaves)


def test_dense_leaves_are_reduced_whole(corpus, tmp_path):
  """optimizer.scape.dense_leaves: the embedding is all-reduced in full,
  beside the selected values; a part matching no parameter names itself."""
  density, n = 0.01, 8

  def reduced(*overrides):
    program = trainer.build_program(_cfg(
        corpus, tmp_path, '--config.optimizer.name=scape',
        f'--config.optimizer.scape.density={density}', '--config.steps=10',
        *overrides))
    cols = analysis.collectives_from_hlo(
        program.compile_step(5, run=False).as_text())
    return program, sum(c.elements for c in cols if c.kind == 'all-reduce')

  program, base = reduced()
  _, more = reduced('--config.optimizer.scape.dense_leaves=embed_tokens')
  [embedding] = [p for path, p in jax.tree_util.tree_flatten_with_path(
      program.abstract_params)[0] if 'embed_tokens' in str(path)]
  size = int(np.prod(embedding.shape))
  k = masks.chunk_k(density, masks.LeafLayout.create(size, n).chunk_size)
  assert more - base == size - n * k
  with pytest.raises(config_lib.ConfigError,
                     match=r"optimizer.scape.dense_leaves: \['embeding'\] "
                     'match no parameter path'):
    reduced('--config.optimizer.scape.dense_leaves=embeding')


def test_interleaved_leaves_reorder_the_named_leaf_on_the_same_wire(
    corpus, tmp_path):
  """optimizer.scape.interleaved_leaves=embed_tokens: after one step SCAPE's
  first moment of the embedding is the plain run's in `interleave`'s order
  (and the head's is the plain run's); the compiled step's collectives are
  the same, kind by kind and element by element. A part matching no
  parameter and Algorithm 2 are refused by name."""
  from scape_jax.optim import _interleave  # pylint: disable=g-import-not-at-top

  def program(*overrides):
    return trainer.build_program(_cfg(
        corpus, tmp_path, '--config.optimizer.name=scape',
        '--config.optimizer.scape.density=0.01', '--config.steps=10',
        *overrides))

  def first_moment(prog):
    params, opt_state = prog.init_state()
    tokens = np.random.default_rng(0).integers(
        0, 256, size=(prog.cfg.data.batch_size, prog.cfg.data.seq_len + 1),
        dtype=np.int32)
    batch = jax.device_put({'inputs': tokens[:, :-1],
                            'targets': tokens[:, 1:]}, prog.batch_sharding())
    _, opt_state, _ = prog.compile_step(0)(params, opt_state, batch)
    return next(
        s for s in jax.tree.leaves(opt_state, is_leaf=_is_scape)
        if _is_scape(s)).mu

  def collectives(prog):
    text = prog.compile_step(5, run=False).as_text()
    return [(c.kind, c.elements)
            for c in analysis.collectives_from_hlo(text)]

  key = '--config.optimizer.scape.interleaved_leaves='
  plain, dealt = program(), program(key + 'embed_tokens')
  mu_plain, mu_dealt = first_moment(plain), first_moment(dealt)
  embed = np.asarray(mu_plain['embed_tokens']['embedding'])
  np.testing.assert_allclose(
      np.asarray(mu_dealt['embed_tokens']['embedding']),
      np.asarray(_interleave.interleave(embed, 8)), rtol=1e-6, atol=1e-12)
  assert not np.allclose(mu_dealt['embed_tokens']['embedding'], embed)
  np.testing.assert_allclose(np.asarray(mu_dealt['lm_head']['kernel']),
                             np.asarray(mu_plain['lm_head']['kernel']),
                             rtol=1e-6, atol=1e-12)
  assert collectives(dealt) == collectives(plain)
  for extra, message in [
      ((key + 'embeding',), r"interleaved_leaves: \['embeding'\] match no"),
      ((key + 'embed_tokens', '--config.optimizer.scape.distributed=true'),
       "interleaved_leaves='embed_tokens' with distributed=True")]:
    with pytest.raises(config_lib.ConfigError, match=message):
      collectives(program(*extra))


def _is_scape(x):
  return isinstance(x, scape_jax.ScaleByScapeState)


def test_dense_train_step_reduces_every_parameter(corpus, tmp_path):
  program = trainer.build_program(_cfg(corpus, tmp_path, '--config.steps=2'))
  cols = analysis.collectives_from_hlo(
      program.compile_step(1, run=False).as_text())
  params = trainer.param_count(program)
  reduced = sum(c.elements for c in cols if c.kind == 'all-reduce')
  assert params <= reduced <= params + 8


def test_dry_run_reports_memory_without_allocating(corpus, tmp_path, capsys):
  """Also: a GPU config (select='pallas_radix') dry-runs on simulated CPU
  devices, compiled as 'threshold' and said so (a real CPU run is
  refused)."""
  cfg = _cfg(corpus, tmp_path, '--config.optimizer.name=scape',
             '--config.mesh.data=8', '--config.optimizer.scape.select='
             'pallas_radix')
  report = trainer.dry_run(cfg)
  assert report['params'] == 131_392  # llama-tiny
  assert report['device_bytes'] > report['params'] * 4
  out, err = capsys.readouterr()
  assert 'parameters' in out
  assert ("note: dry run on cpu devices: optimizer.scape.select="
          "'pallas_radix' is compiled as 'threshold'") in err
  with pytest.raises(config_lib.ConfigError, match='runs Pallas kernels'):
    trainer.build_program(cfg)


def test_dry_run_reports_the_program_most_steps_run(corpus, tmp_path):
  """Radius with T = 10: the sparse step's bytes whatever the parity of
  steps (it compiled the update after the last step, a resample at 99)."""
  reports = [trainer.dry_run(_cfg(
      corpus, tmp_path, '--config.optimizer.name=radius',
      '--config.optimizer.radius.interval=10', f'--config.steps={steps}'))
             for steps in (99, 100)]
  assert [r['steady_program'] for r in reports] == [
      {'step_kind': 'sparse'}] * 2
  assert reports[0]['comm_bytes_per_step'] == reports[1][
      'comm_bytes_per_step']
  assert reports[1]['steady_steps'] == 100 - 19 - 9  # dense 1-19, 9 resamples


def test_a_program_compiled_to_be_read_is_the_program_a_run_compiles(
    corpus, tmp_path):
  """`compile_step(run=False)` (the dry run's, the benches' tables): on CPU
  devices without LLVM's optimizations (other machine code), the same HLO,
  buffers and collectives as the program a run compiles."""
  cfg = _cfg(corpus, tmp_path, '--config.optimizer.name=scape',
             '--config.optimizer.scape.density=0.1')
  program = trainer.build_program(cfg)
  traced = program.trace_step(5)

  def read(compiled):
    mem = compiled.memory_analysis()
    text = compiled.as_text()  # instructions, not the source tables
    return (analysis.collectives_from_hlo(text),
            [line.split(', metadata=')[0] for line in text.splitlines()
             if line.lstrip().startswith(('%', 'ROOT', 'ENTRY'))],
            mem.temp_size_in_bytes, mem.argument_size_in_bytes,
            mem.output_size_in_bytes, mem.alias_size_in_bytes)

  run, read_only = (program.compile_step(5, traced, run=r)
                    for r in (True, False))
  assert read(read_only) == read(run)
  code = [serialize_executable.serialize(c)[0] for c in (run, read_only)]
  assert code[0] != code[1]


@pytest.mark.parametrize('override, message', [
    ('--config.data.batch_size=12', 'not divisible by the 8'),
    ('--config.data.micro_batches=3', 'data.micro_batches=3'),
    ('--config.data.seq_len=4096', 'exceeds the max_seq_len'),
    ('--config.mesh.data=3', 'mesh.data=3 .* does not fit'),
    ('--config.mesh.tensor=2', 'mesh.tensor=2'),
    ('--config.model.preset=llama9b', "unknown model 'llama9b'"),
])
def test_bad_settings_fail_before_training(corpus, tmp_path, override,
                                           message):
  with pytest.raises(ValueError, match=message):
    trainer.build_program(_cfg(corpus, tmp_path, override))
