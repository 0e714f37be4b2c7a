"""Tests for scape_jax.analysis: collectives read from compiled HLO.

Observed on CPU XLA (jax 0.10.2, 8 simulated devices), and asserted below:
  * psum -> all-reduce, all_gather -> all-gather, psum_scatter ->
    reduce-scatter, ppermute -> collective-permute: emitted as such.
  * all_to_all -> all-to-all in tuple form (one f32[k] operand per peer);
    the parser sums the operands.
  * bf16 collectives are promoted to f32 on CPU (convert, f32 collective,
    convert back, a `*_promoted` reduction): the parser prices them as the
    program sends them, in bf16, with a note; bf16 byte sizes are also
    checked on handwritten HLO.
  * Independent psums are combined into one tuple-shaped all-reduce.
  * fori_loop bodies keep a `while` with `known_trip_count` in backend_config.
  * Automatic (GSPMD) partitioning prints replica_groups in the mesh-axes form
    `mesh['axis_0'=2,'axis_1'=4] {'axis_0'}`.
"""

# pylint: disable=line-too-long  (handwritten HLO lines)

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P
import pytest

from scape_jax import analysis

MESH = jax.make_mesh((8,), ('data',))
MESH2 = jax.make_mesh((2, 4), ('a', 'b'))


def _sds(shape, dtype=jnp.float32, spec=P('data'), mesh=MESH):
  return jax.ShapeDtypeStruct(shape, dtype,
                              sharding=NamedSharding(mesh, spec))


def _smap(f, in_specs=P('data'), out_specs=P('data'), mesh=MESH):
  return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs,
                               out_specs=out_specs, check_vma=False))


def _one(cols):
  assert len(cols) == 1, analysis.format_table(cols)
  return cols[0]


# --------------------------------------------------------------------------
# Compiled programs.


def test_psum_all_reduce():
  c = _one(analysis.collectives(_smap(lambda x: lax.psum(x, 'data')),
                            _sds((8000,))))
  assert (c.kind, c.dtype, c.elements, c.group_size, c.count) == (
      'all-reduce', 'f32', 1000, 8, 1)
  assert c.bytes == 4000
  assert c.bytes_sent == pytest.approx(2 * 7 / 8 * 4000)
  assert analysis.bytes_sent([c]) == pytest.approx(2 * 7 / 8 * 4000)


def test_all_gather_counts_output():
  f = _smap(lambda x: lax.all_gather(x, 'data', tiled=True))
  c = _one(analysis.collectives(f, _sds((128,))))
  assert (c.kind, c.dtype, c.elements, c.group_size) == (
      'all-gather', 'f32', 128, 8)
  assert c.bytes_sent == pytest.approx(7 / 8 * 512)


def test_psum_scatter_reduce_scatter_counts_input():
  f = _smap(lambda x: lax.psum_scatter(x, 'data', tiled=True))
  c = _one(analysis.collectives(f, _sds((512,))))
  assert (c.kind, c.elements, c.group_size) == ('reduce-scatter', 64, 8)
  assert c.bytes_sent == pytest.approx(7 / 8 * 256)


def test_ppermute_and_all_to_all():
  ring = [(i, (i + 1) % 8) for i in range(8)]
  c = _one(analysis.collectives(_smap(lambda x: lax.ppermute(x, 'data', ring)),
                            _sds((128,))))
  assert (c.kind, c.elements, c.group_size) == ('collective-permute', 16, 8)
  assert c.bytes_sent == 64
  # CPU emits the tuple form: 8 operands of f32[8]; S is their sum.
  f = _smap(lambda x: lax.all_to_all(x, 'data', 0, 0, tiled=True))
  c = _one(analysis.collectives(f, _sds((512,))))
  assert (c.kind, c.dtype, c.elements, c.group_size) == (
      'all-to-all', 'f32', 64, 8)
  assert c.bytes_sent == pytest.approx(7 / 8 * 256)


def test_sub_groups_of_2d_mesh():
  spec = P(('a', 'b'))
  f = _smap(lambda x: (lax.psum(x, 'b'), lax.psum(x, 'a')), in_specs=spec,
            out_specs=(spec, spec), mesh=MESH2)
  cols = analysis.collectives(f, _sds((64,), spec=spec, mesh=MESH2))
  assert sorted(c.group_size for c in cols) == [2, 4]
  f = _smap(lambda x: lax.psum(x, ('a', 'b')), in_specs=spec, out_specs=spec,
            mesh=MESH2)
  assert _one(analysis.collectives(f, _sds((64,), spec=spec,
                                       mesh=MESH2))).group_size == 8


def test_gspmd_mesh_axes_replica_groups():
  x = _sds((8, 16), spec=P('a', 'b'), mesh=MESH2)
  f = jax.jit(lambda x: jnp.sum(x, axis=0),
              out_shardings=NamedSharding(MESH2, P('b')))
  c = _one(analysis.collectives(f, x))
  assert (c.kind, c.elements, c.group_size) == ('all-reduce', 4, 2)
  c = _one(analysis.collectives(lambda x: jnp.sum(x), _sds((64,))))  # Not jitted.
  assert (c.kind, c.elements, c.group_size) == ('all-reduce', 1, 8)


def test_dtypes():
  f = _smap(lambda x: lax.psum(x, 'data'))
  c = _one(analysis.collectives(f, _sds((64,), jnp.int32)))
  assert (c.dtype, c.elements, c.bytes) == ('s32', 8, 32)
  f = _smap(lambda x: lax.all_gather(x, 'data', tiled=True))
  c = _one(analysis.collectives(f, _sds((64,), jnp.uint8)))
  assert (c.dtype, c.elements, c.bytes) == ('u8', 64, 64)
  # bf16: XLA:CPU moves the collective as f32; it is priced as sent, bf16.
  on_cpu = jax.default_backend() == 'cpu'
  for collective in (lambda x: lax.psum(x, 'data'),
                     lambda x: lax.all_gather(x, 'data', tiled=True) * 2):
    c = _one(analysis.collectives(_smap(collective),
                                  _sds((64,), jnp.bfloat16)))
    assert (c.dtype, c.bytes) == ('bf16', 16 if c.kind == 'all-reduce'
                                  else 128), c
    assert ('widened to f32 by the compiler' in c.note) == on_cpu
  # A program that reduces in f32 on purpose is priced in f32.
  c = _one(analysis.collectives(_smap(
      lambda x: lax.psum(x.astype(jnp.float32), 'data')),
                                _sds((64,), jnp.bfloat16)))
  assert (c.dtype, c.bytes, c.note) == ('f32', 32, '')


def test_unpriced_kinds_are_listed_and_make_the_total_incomplete():
  text = """HloModule m, num_partitions=8

ENTRY %main (p: f32[1024]) -> f32[1024] {
  %p = f32[1024]{0} parameter(0)
  %cb = f32[1024]{0} collective-broadcast(%p), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}
  %tok = token[] after-all()
  %send = (f32[1024]{0}, u32[], token[]) send(f32[1024]{0} %cb, token[] %tok), channel_id=3
  %send-done = token[] send-done((f32[1024]{0}, u32[], token[]) %send), channel_id=3
  ROOT %o = f32[1024]{0} copy(%cb)
}
"""
  cols = analysis.collectives_from_hlo(text)
  assert [(c.kind, c.dtype, c.elements, c.count) for c in cols] == [
      ('collective-broadcast', 'f32', 1024, None), ('send', 'f32', 1024, None)]
  assert 'INCOMPLETE: 2 collective(s)' in analysis.format_table(cols)
  assert analysis.bytes_sent(cols) == 0


def test_combined_psums_tuple_all_reduce():
  f = _smap(lambda x, y: (lax.psum(x, 'data'), lax.psum(y, 'data')),
            in_specs=(P('data'), P('data')), out_specs=(P('data'), P('data')))
  cols = analysis.collectives(f, _sds((64,)), _sds((32,)))
  assert sum(c.elements for c in cols) == 8 + 4
  assert analysis.bytes_sent(cols) == pytest.approx(2 * 7 / 8 * 48)


def _loop(x):
  return lax.fori_loop(0, 5, lambda i, c: lax.psum(c, 'data') * 0.5, x)


def test_fori_loop_trip_count():
  f, x = _smap(_loop), _sds((128,))
  text = f.lower(x).compile().as_text()
  cols = analysis.collectives(f, x)
  if 'known_trip_count' in text:  # What jax 0.10.2 on CPU does.
    c = _one(cols)
    assert (c.count, c.note) == (5, '')
    assert c.bytes_sent == pytest.approx(5 * 2 * 7 / 8 * 64)
  elif 'while(' in text:
    assert all(c.count is None and c.note == analysis.NOTE_TRIP_UNKNOWN
               for c in cols)
  else:  # Unrolled: five separate all-reduces.
    assert sum(c.count for c in cols) == 5


def test_nested_loops_multiply():
  body = lambda i, c: lax.fori_loop(0, 4, lambda j, d: lax.psum(d, 'data'), c)
  f = _smap(lambda x: lax.fori_loop(0, 3, body, x))
  cols = analysis.collectives(f, _sds((128,)))
  assert sum(c.count for c in cols) == 12


def test_data_dependent_while_not_guessed():
  def f(x):
    cond = lambda c: c[0] < c[1][0]
    body = lambda c: (c[0] + 1, lax.psum(c[1], 'data'))
    return lax.while_loop(cond, body, (0, x))[1]
  c = _one(analysis.collectives(_smap(f), _sds((128,))))
  assert c.count is None and c.note == analysis.NOTE_TRIP_UNKNOWN
  assert c.bytes_sent == 0 and analysis.bytes_sent([c]) == 0
  assert 'INCOMPLETE' in analysis.format_table([c])


def test_cond_branch_flagged():
  f = _smap(lambda x: lax.cond(x[0] > 0, lambda c: lax.psum(c, 'data'),
                               lambda c: c * 2, x))
  c = _one(analysis.collectives(f, _sds((128,))))
  assert c.kind == 'all-reduce'
  assert c.count is None and c.note == analysis.NOTE_IN_BRANCH
  assert 'INCOMPLETE' in analysis.format_table([c])


def test_cond_under_the_taken_scope_counted_once():
  """The train step's update branch (`TAKEN_SCOPE`) counts as taken; a cond
  nested in it stays unknown."""
  def nested(c):
    return lax.cond(c[1] > 0, lambda y: lax.pmax(y, 'data'), jnp.sin, c)

  def f(x):
    with jax.named_scope(analysis.hlo.TAKEN_SCOPE):
      return lax.cond(x[0] > 0, lambda c: nested(lax.psum(c, 'data')),
                      lambda c: c * 2, x)
  cols = analysis.collectives(_smap(f), _sds((128,)))
  assert [(x.count, x.note) for x in cols if 'pmax' in x.op_name] == [
      (None, analysis.NOTE_IN_BRANCH)]
  c = _one([x for x in cols if 'pmax' not in x.op_name])
  assert (c.kind, c.count, c.note) == ('all-reduce', 1, '')
  assert c.bytes_sent == analysis.ring_all_reduce_bytes(16 * 4, 8)  # a shard
  assert 'INCOMPLETE' not in analysis.format_table([c])


# --------------------------------------------------------------------------
# Parser on handwritten HLO.

_ADD = """
%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}
"""


def _module(entry_body, params='p: f32[16]', extra=''):
  return (f'HloModule m, num_partitions=8\n{_ADD}{extra}\n'
          f'ENTRY %main ({params}) -> f32[] {{\n{entry_body}\n}}\n')


def test_parse_tuple_all_reduce_mixed_dtypes():
  hlo = _module("""
  %p0 = f32[1000]{0} parameter(0)
  %p1 = f32[24]{0} parameter(1)
  %p2 = bf16[64]{0} parameter(2)
  ROOT %ar = (f32[1000]{0}, f32[24]{0}, /*index=2*/bf16[64]{0}) all-reduce(%p0, %p1, %p2), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add, metadata={op_name="body=%x"}""",
                params='p0: f32[1000], p1: f32[24], p2: bf16[64]')
  cols = analysis.collectives_from_hlo(hlo, 8)
  got = {(c.kind, c.dtype, c.elements, c.group_size, c.count) for c in cols}
  assert got == {('all-reduce', 'f32', 1024, 4, 1),
                 ('all-reduce', 'bf16', 64, 4, 1)}
  assert sum(c.bytes for c in cols) == 4096 + 128


@pytest.mark.parametrize('groups, n', [
    ('[2,4]<=[8]', 4), ('[4,2]<=[2,4]T(1,0)', 2), ('{}', 8),
    ('{{0,1,2,3,4,5,6,7}}', 8), ('{{0},{1},{2},{3},{4},{5},{6},{7}}', 1),
    ("mesh['x'=2,'y'=4] {'y'}", 4), ("mesh['x'=2,'y'=4] {'x','y'}", 8),
    ("mesh['x'=2,'y'=4] {}", 1), ("mesh['x'=8] {'x':(1)2}", 2),
])
def test_parse_replica_groups(groups, n):
  hlo = _module(f"""
  %p = f32[16]{{0}} parameter(0)
  ROOT %ar = f32[16]{{0}} all-reduce(%p), channel_id=1, replica_groups={groups}, use_global_device_ids=true, to_apply=%add""")
  c = _one(analysis.collectives_from_hlo(hlo, 8))
  assert c.group_size == n
  assert c.bytes_sent == pytest.approx(analysis.ring_all_reduce_bytes(64, n))


def test_parse_async_pairs_counted_once():
  wrapped = """
%wrapped_rs (x: f32[64]) -> f32[8] {
  %x = f32[64]{0} parameter(0)
  ROOT %rs = f32[8]{0} reduce-scatter(%x), channel_id=4, replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add
}
"""
  hlo = _module("""
  %p = f32[16]{0} parameter(0)
  %ags = (f32[16]{0}, f32[128]{0}) all-gather-start(%p), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}, use_global_device_ids=true
  %agd = f32[128]{0} all-gather-done(%ags)
  %ars = f32[128]{0} all-reduce-start(%agd), channel_id=2, replica_groups={}, to_apply=%add
  %ard = f32[128]{0} all-reduce-done(%ars)
  %cps = (f32[128]{0}, f32[128]{0}, u32[], u32[]) collective-permute-start(%ard), channel_id=3, source_target_pairs={{0,1},{1,0}}
  %cpd = f32[128]{0} collective-permute-done(%cps)
  %slc = f32[64]{0} slice(%cpd), slice={[0:64]}
  %as = ((f32[64]{0}), f32[8]{0}, s32[]) async-start(%slc), calls=%wrapped_rs
  ROOT %ad = f32[8]{0} async-done(%as), calls=%wrapped_rs""", extra=wrapped)
  cols = analysis.collectives_from_hlo(hlo)  # num_devices from the header.
  got = [(c.kind, c.elements, c.group_size, c.count) for c in cols]
  assert sorted(got) == sorted([('all-gather', 128, 8, 1),
                                ('all-reduce', 128, 8, 1),
                                ('collective-permute', 128, 2, 1),
                                ('reduce-scatter', 64, 8, 1)])


def test_parse_inline_operand_shapes_and_f8():
  hlo = ('ENTRY %e (p: f8e4m3fn[32]) -> f8e4m3fn[256] {\n'
         '  ROOT %ag = f8e4m3fn[256]{0} all-gather(f8e4m3fn[32]{0} %p), '
         'replica_groups={}, dimensions={0}\n}\n')
  c = _one(analysis.collectives_from_hlo(hlo, 8))
  assert (c.dtype, c.elements, c.bytes) == ('f8e4m3fn', 256, 256)


_LOOPS = """
%inner_body (t: (s32[], f32[16])) -> (s32[], f32[16]) {
  %t = (s32[], f32[16]{0}) parameter(0)
  %v = f32[16]{0} get-tuple-element(%t), index=1
  %ar = f32[16]{0} all-reduce(%v), replica_groups={}, to_apply=%add
  ROOT %r = (s32[], f32[16]{0}) tuple(%i, %ar)
}
%outer_body (t2: (s32[], f32[16])) -> (s32[], f32[16]) {
  %t2 = (s32[], f32[16]{0}) parameter(0)
  ROOT %w = (s32[], f32[16]{0}) while(%t2), condition=%c, body=%inner_body, backend_config=TRIP
}
%br (y: f32[16]) -> f32[16] {
  %y = f32[16]{0} parameter(0)
  ROOT %ag = f32[16]{0} all-to-all(%y), replica_groups={}, dimensions={0}
}
"""


@pytest.mark.parametrize('outer, inner, count, note', [
    ('{"known_trip_count":{"n":"3"}}', '{"known_trip_count":{"n":"4"}}', 12,
     ''),
    ('"{\\"known_trip_count\\":{\\"n\\":\\"3\\"}}"', '{}', None,
     analysis.NOTE_TRIP_UNKNOWN),
    ('{}', '{"known_trip_count":{"n":"4"}}', None, analysis.NOTE_TRIP_UNKNOWN),
])
def test_parse_nested_while_and_conditional(outer, inner, count, note):
  hlo = _module(f"""
  %p = f32[16]{{0}} parameter(0)
  %w0 = (s32[], f32[16]{{0}}) while(%t0), condition=%c, body=%outer_body, backend_config={outer}
  ROOT %cd = f32[16]{{0}} conditional(%pred, %p, %p), true_computation=%br, false_computation=%add""",
                extra=_LOOPS.replace('TRIP', inner))
  cols = {c.kind: c for c in analysis.collectives_from_hlo(hlo, 8)}
  assert (cols['all-reduce'].count, cols['all-reduce'].note) == (count, note)
  assert cols['all-to-all'].count is None
  assert cols['all-to-all'].note == analysis.NOTE_IN_BRANCH
  table = analysis.format_table(list(cols.values()))
  assert 'INCOMPLETE' in table and 'all-to-all' in table


def test_ring_helpers_and_group_of_one():
  assert analysis.ring_all_reduce_bytes(800, 8) == pytest.approx(1400)
  assert analysis.ring_all_gather_bytes(800, 8) == pytest.approx(700)
  assert analysis.ring_reduce_scatter_bytes(800, 4) == pytest.approx(600)
  assert analysis.ring_all_reduce_bytes(800, 1) == 0
  c = analysis.Collective('collective-permute', 'bf16', 10, 1, 3, 'x')
  assert (c.bytes, c.bytes_sent) == (20, 0)
  c = analysis.Collective('collective-permute', 'bf16', 10, 2, 3, 'x')
  assert c.bytes_sent == 60
