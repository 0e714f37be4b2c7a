"""The XLA flags that the tests compile with (conftest.py sets them before
jax is imported; the tests that start train.py or bench/ processes pass them).

Compiling dominates the tests. These flags change only how XLA:CPU emits the
machine code of each fusion; the HLO passes, where the fusions and the
collectives are formed, are unaffected: no LLVM optimization, and the loop
emitters instead of the fusion emitters, which take longer to compile each
distinct kernel. Two programs that do the same arithmetic in other fusions
may then round apart by an ulp: tests of such variants compare their states
with `mesh_runner.assert_same_states`. A test of a fusion decision of the
default emitters compiles with them (`compile({...: True})`).
"""

FLAGS = ('--xla_backend_optimization_level=0 '
         '--xla_llvm_disable_expensive_passes=true '
         '--xla_cpu_use_fusion_emitters=false')
