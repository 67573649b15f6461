"""One module per MoE engine, each an ``engine.SkeletonEngine`` that writes its count exchange and its row
move (``engine`` draws the skeleton):

- ``torch``: torch.distributed all-gather and all-to-all (``moe.collectives``); the reference.
- ``nixl``: one-sided WRITEs into peers' registered buffers, completed by notifications.
- ``cuda``: Triton kernels (``moe.kernels``) storing into peers' GPU memory through CUDA IPC, with its
  helpers ``cuda_spaces`` (buffers), ``cuda_steps`` (launches), ``cuda_routing`` (routing tables) and
  ``cuda_waits`` (stream waits and their watchdog).

``moe.selection`` imports a module here when its engine is first created; nothing here is imported by
``import tensorwire``.
"""
