"""Finds reductions whose operands are all known at trace time: XLA folds
those on the host, element by element (minutes on a large leaf)."""

import jax
import jax.extend


def constant_reductions(jaxpr, constant=frozenset()) -> list:
  """Reductions in `jaxpr` (sub-jaxprs included) whose every operand is
  known at trace time."""
  known, found = set(constant), []
  for eqn in jaxpr.eqns:
    ins = [isinstance(v, jax.extend.core.Literal) or v in known
           for v in eqn.invars]
    sub = eqn.params.get('jaxpr')
    if sub is not None and hasattr(sub, 'jaxpr'):
      inner = frozenset(v for v, c in zip(sub.jaxpr.invars, ins) if c)
      found += constant_reductions(sub.jaxpr, inner)
    if all(ins):
      if eqn.primitive.name.startswith(('reduce', 'arg')):
        found.append(eqn)
      known.update(eqn.outvars)
  return found
