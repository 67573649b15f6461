"""The ``"cuda"`` MoE backend: Triton kernels that store rows straight into peers' GPU memory.

- ``nvlink``: the kernels (Triton; imported only when the backend runs) and the data-flow, signal-layout
  and memory-ordering contract in its docstring.
- ``cuda_engine``: the host op: workspaces (registered, mapped into every peer through CUDA IPC), the
  tables computed with torch ops on the device, and the launches.

Nothing here imports Triton or touches CUDA at import time.
"""
