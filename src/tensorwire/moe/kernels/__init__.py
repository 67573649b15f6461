"""Triton kernels of the ``"cuda"`` MoE engine, and nothing else: every function here is ``@triton.jit``.

- ``nvlink``: the row kernels (count exchange, row stores, combine's pulls, flag consumption) and the
  data-flow, signal-layout and memory-ordering contract in its docstring.
- ``routing``: the routing tables (send order, block tables, error bits).

Their host side (buffers, launches with keyword arguments) is in ``tensorwire.moe.engines``. Nothing here
is imported by ``tensorwire.moe`` until the ``cuda`` engine is created: importing these modules imports Triton.
"""
