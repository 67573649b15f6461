"""The engine's KV cache as a tensorwire block pool, the fingerprint that both instances compare, the order of a
block's rows, and how the model's KV heads are spread over the engine's tensor-parallel ranks.

vLLM allocates one cache tensor per attention layer. Its layouts:

- K/V first (FlashAttention): ``[2, num_blocks, block_size, kv_heads, head_dim]``; views ``cache[0]``, ``cache[1]``;
- blocks first, K/V inside a block (FlashInfer): ``[num_blocks, 2, block_size, kv_heads, head_dim]``; views
  ``cache[:, 0]``, ``cache[:, 1]`` (the pool registers their common span once);
- the CPU backend: ``[num_blocks, kv_heads, block_size, 2 * head_dim]``, which it reads as each head's K rows then
  its V rows (``kv.BlockShape`` order ``HKND``);
- MLA: ``[num_blocks, block_size, latent]``, the same on every rank.

On GPUs the logical shape stays ``[..., block_size, kv_heads, head_dim]`` whatever the memory order: with the ``HND``
layout (``get_required_kvcache_layout``, which the connector declares for non-MLA models) vLLM hands over a
stride-permuted view whose heads are outermost in memory. ``block_order`` reads the order from the strides, so a pool
registers whatever the engine allocated; ``tensorwire.kv`` pairs rows across orders and block sizes
(``kv.BlockPlan``: ``HND`` on both sides moves a head range as one descriptor per block and view).
"""

from __future__ import annotations

from typing import Any

import torch

import tensorwire as tw
from tensorwire import kv

__all__ = ["fingerprint", "pool_views", "sharding", "block_order", "REQUIRED_ORDER"]

REQUIRED_ORDER = "HND"  # what the connector asks vLLM for (non-MLA): a head range is one byte range of a block


def fingerprint(vllm_config: Any) -> str:
    """What must match between producer and consumer for blocks to be interchangeable, readable in an error
    message: model architecture and KV shape (all heads, not one rank's), cache dtype. Not the tensor parallelism
    (the head map reads across TP sizes), the block size (a handoff names its own; ``kv.BlockPlan`` pairs sizes where
    one divides the other; but on the CPU backend, whose kernels pack a head's rows per block for the machine's
    vector unit, the block size is part of it), the memory order (read from the strides), nor the weights (two
    instances of one architecture with different weights have the same layout)."""
    model, cache, parallel = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    architecture = ",".join(getattr(model, "architectures", None) or [type(model.hf_config).__name__])
    dtype = model.dtype if cache.cache_dtype in (None, "auto") else cache.cache_dtype
    attention = "mla" if getattr(model, "use_mla", False) else f"kv_heads={model.get_total_num_kv_heads()}"
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", "")
    packed = f" cpu_block_size={cache.block_size} cpu_kernels={_cpu_kernels(vllm_config)}" if device == "cpu" else ""
    return (f"{architecture} layers={model.get_num_layers(parallel)} {attention} head_dim={model.get_head_size()} "
            f"kv_dtype={str(dtype).removeprefix('torch.')}{packed}")


def _cpu_kernels(vllm_config: Any) -> str:
    """The instruction set vLLM's CPU attention packs its cache for (``amx``, ``vec``, ``neon``...): caches packed
    for different ones hold different bytes. vLLM's own choice where this vLLM exposes it, else the machine."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return _get_attn_isa(model.dtype, cache.block_size, model.get_head_size(), cache.cache_dtype)
    except Exception:  # noqa: BLE001 - another vLLM version: the machine is the next best thing to compare
        import platform

        return platform.machine() or "unknown"


def sharding(vllm_config: Any) -> kv.Sharding:
    """The engine's KV heads over its tensor-parallel ranks: MLA's latent cache is whole on every rank."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    if getattr(model, "use_mla", False):
        return kv.Sharding(parallel.tensor_parallel_size, 1, replicated=True)
    return kv.Sharding(parallel.tensor_parallel_size, model.get_total_num_kv_heads())


def block_order(views: list[torch.Tensor], block_size: int, local_heads: int) -> str:
    """The order of the rows (one head of one token) in a block of every view of ``pool_views``: ``"HND"`` (heads
    outermost), ``"NHD"`` (tokens outermost), read from the views' strides, or ``"HKND"`` (the CPU backend's cache:
    per head its K rows then its V rows). Raises ``tw.InvalidArgumentError`` for
    a view of no known shape, or views of different orders."""
    orders = {_order(view, block_size, local_heads) for view in views}
    if None in orders or len(orders) != 1:
        shapes = sorted({(tuple(v.shape), v.stride()) for v in views})[:3]
        raise tw.InvalidArgumentError(
            f"TensorwireConnector: KV cache views of shapes/strides {shapes} hold no block of {block_size} tokens x "
            f"{local_heads} heads in one order (HND or NHD); this attention backend's layout is not supported")
    return orders.pop()


def _order(view: torch.Tensor, block_size: int, local_heads: int) -> str | None:
    shape, strides = tuple(view.shape[1:]), view.stride()[1:]
    if len(shape) == 2 and shape[0] == block_size:  # MLA: [block_size, latent], one head per token
        return "NHD"
    if len(shape) != 3:
        return None
    if view.device.type == "cpu" and shape[:2] == (local_heads, block_size):  # the CPU backend's [heads, block, 2d]
        return "HKND"  # read as [heads, 2 * block, d]: K's rows, then V's
    if shape[:2] != (block_size, local_heads):
        return None
    if block_size == 1 or local_heads == 1:
        return "HND"  # both orders are one: heads outermost is the one a head range needs
    return "HND" if strides[1] > strides[0] else "NHD"


def pool_views(kv_caches: dict[str, torch.Tensor], num_blocks: int) -> list[torch.Tensor]:
    """The views ``[num_blocks, ...]`` of ``kv_caches`` (vLLM's ``{layer name: cache}``, in layer order) for
    ``register_blocks``; a tensor shared by several layers is taken once. Raises ``tw.InvalidArgumentError`` for a
    cache whose dims hold neither layout."""
    views, seen = [], set()
    for layer, cache in kv_caches.items():
        if cache.data_ptr() in seen:
            continue
        seen.add(cache.data_ptr())
        if cache.dim() == 5 and cache.shape[0] == num_blocks and cache.shape[1] == 2:  # FlashInfer: K/V per block
            views.extend((cache[:, 0], cache[:, 1]))
        elif cache.dim() >= 2 and cache.shape[0] == num_blocks:
            views.append(cache)
        elif cache.dim() >= 3 and cache.shape[0] == 2 and cache.shape[1] == num_blocks:
            views.extend((cache[0], cache[1]))
        else:
            raise tw.InvalidArgumentError(
                f"TensorwireConnector: the KV cache of {layer} has shape {tuple(cache.shape)}, and neither dim 0 nor "
                f"dim 1 (after K/V) is the engine's {num_blocks} blocks; this attention backend's layout is not "
                "supported")
    if not views:
        raise tw.InvalidArgumentError("TensorwireConnector: register_kv_caches got no KV cache tensors")
    return views
