"""Benchmarks, correctness sweeps and profiling behind the ``flashkernel`` command line.

Modules (each small, importable without a GPU; kernels are imported only inside functions so
the CLI can choose Triton's CPU interpreter first):

* ``formulas``  FLOP and byte counts, the numbers every figure is derived from.
* ``measure``   timing (CUDA events, CUDA graphs, CPU wall clock) and its statistics.
* ``suites``    benchmark cases and the default sweeps.
* ``providers`` one ``Provider`` shape for everything that computes attention.
* ``registry``  every provider (flashkernel, SDPA, ``flex``, ``external``), in table order.
* ``accuracy``  comparison against the float64 reference, shared by ``bench`` and ``check``.
* ``runner``    runs a suite through the providers into result rows.
* ``results``   environment, JSON / CSV files, readable tables.
* ``plots``     PNG charts from result rows (needs the optional ``plot`` extra: matplotlib).
* ``ceilings``  device facts and measured copy bandwidth / matmul TFLOP/s (cached).
* ``check``     the correctness sweep of every public function.
* ``profile``   one configuration under Nsight Compute plus Triton's resource report.
* ``compile_check`` the Gluon kernels compiled for sm_90a without a GPU: spills, the instructions
  their design rests on (``python -m flashkernel.bench.compile_check``; ``tests/test_gluon_compile.py``).
"""
