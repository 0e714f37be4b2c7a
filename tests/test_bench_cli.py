"""The bench scripts' command lines, run as a user runs them: a bad value is a
usage error (exit 2, naming the option and the value) before any work, never
a traceback after minutes of compiling, a silent default or an empty table."""

import pytest

from tests import bench_scripts

# (script, argv, what stderr says). {file} is a regular file, {missing} a
# path that does not exist. One case per kind of check and script.
USAGE_ERRORS = [
    ('optimizer_overhead', ['--repeats', '0'],
     'argument --repeats: 0: must be an integer >= 1'),
    ('optimizer_overhead', ['--number', '1.5'], "'1.5' is not an integer"),
    ('optimizer_overhead', ['--densities', '0'], 'density 0.0: must be in'),
    ('optimizer_overhead', ['--densities', 'abc'], "'abc' is not a number"),
    ('optimizer_overhead', ['--selects', 'radix'], 'invalid choice'),
    # Checked before compiling (it ended a run's hour with a traceback).
    ('optimizer_overhead', ['--quick', '--out', '{file}/x'],
     'cannot create it'),
    ('comm_volume', ['--out', '{file}/x'], 'cannot create it'),
    ('comm_volume', ['--no-outer', '--outer-only'],
     'not allowed with argument --no-outer'),
    ('comm_volume', ['--outer-only', '--workers', '4'],
     'nothing to measure: --outer-only needs'),
    ('comm_volume', ['--models', 'bogus', '--workers', '2', '--methods',
                     'adamw'], "unknown model 'bogus'"),
    ('comm_volume', ['--models', 'llama-tiny', '--workers', '64',
                     '--methods', 'adamw'], '--workers 64: at most 32'),
    ('projected_step_time', ['--compute-ms', '-50'],
     'argument --compute-ms: -50.0: must be >= 0'),
    ('projected_step_time', ['--compute-ms', 'nan'], 'must be finite'),
    ('projected_step_time', ['--effective-tflops', '0',
                             '--tokens-per-worker', '1000'],
     'argument --effective-tflops: 0.0: must be > 0'),
    ('projected_step_time', ['--compute-ms', '1', '--comm-json',
                             '{missing}'], 'no such file'),
    ('fcdp_volume', ['--models', 'bogus'], "invalid choice: 'bogus'"),
    ('memory_table', ['--configs', 'bogus', '--no-compile'],
     'no configs/bogus.py; allowed: gpt345m'),
    ('eval_downstream', ['--run', '{missing}', '--limit', '0'],
     'leave --limit out for every example'),
    ('convergence', ['--steps', '0'], 'argument --steps'),
    ('netlab', ['sample', '--out', '{missing}', '--interval', '-1', 'lo'],
     'argument --interval'),
    ('network', ['--set', 'optimzer.lr=1'], "unknown config key 'optimzer'"),
    ('network', ['--workers', '1'], '--workers 1: at least 2'),
    ('network', ['--warmup', '-3'], 'argument --warmup: -3: must be an '
     'integer >= 0'),
    ('network', ['--workers', '3', '--methods', 'DiLoCo'],
     'do not split into mesh.replica=2'),
]


@pytest.mark.parametrize('script, argv, message', USAGE_ERRORS,
                         ids=[f'{s}-{"_".join(a)[:40]}'
                              for s, a, _ in USAGE_ERRORS])
def test_bad_values_are_usage_errors(script, argv, message, tmp_path):
  a_file = tmp_path / 'a_file'
  a_file.write_text('')
  fill = {'file': str(a_file), 'missing': str(tmp_path / 'missing')}
  argv = [a.format(**fill) for a in argv]
  proc = bench_scripts.run(script, *argv, cwd=tmp_path)
  assert proc.returncode == 2, proc.stderr
  assert message in proc.stderr
  assert 'Traceback' not in proc.stderr
  assert not (tmp_path / 'missing').exists()  # nothing was written
