"""Kernels in Gluon (``triton.experimental.gluon``) for Hopper (sm_90a): the warp-specialized
prefill (``prefill.py``), the persistent decode (``decode.py``) and their shared pieces
(``common.py``). Imported only where Gluon exists (``kernels._common.optional_kernel_module``)."""
