"""The engine's KV cache as a tensorwire block pool, and the fingerprint that both instances compare.

vLLM allocates one cache tensor per attention layer. Two layouts occur: blocks first (the CPU backend:
``[num_blocks, kv_heads, block_size, 2 * head_dim]``; FlashInfer: ``[num_blocks, 2, ...]``), where block i of the
layer is ``cache[i]``, and K/V first (FlashAttention: ``[2, num_blocks, block_size, kv_heads, head_dim]``), where
it is ``cache[0][i]`` and ``cache[1][i]``. Either way block i of the pool is that block in every layer, so one
request moves a vLLM block of all layers at once.
"""

from __future__ import annotations

from typing import Any

import torch

import tensorwire as tw

__all__ = ["fingerprint", "pool_views"]


def fingerprint(vllm_config: Any) -> str:
    """What must match between producer and consumer for blocks to be interchangeable, readable in an error
    message: model architecture and KV shape, cache dtype, block size, tensor parallelism. Weights are not in it
    (two instances of one architecture with different weights have the same layout)."""
    model, cache, parallel = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    architecture = ",".join(getattr(model, "architectures", None) or [type(model.hf_config).__name__])
    dtype = model.dtype if cache.cache_dtype in (None, "auto") else cache.cache_dtype
    return (f"{architecture} layers={model.get_num_layers(parallel)} kv_heads={model.get_num_kv_heads(parallel)} "
            f"head_dim={model.get_head_size()} kv_dtype={str(dtype).removeprefix('torch.')} "
            f"block_size={cache.block_size} tp={parallel.tensor_parallel_size}")


def pool_views(kv_caches: dict[str, torch.Tensor], num_blocks: int) -> list[torch.Tensor]:
    """The views ``[num_blocks, ...]`` of ``kv_caches`` (vLLM's ``{layer name: cache}``, in layer order) for
    ``register_blocks``; a tensor shared by several layers is taken once. Raises ``tw.InvalidArgumentError`` for a
    cache whose dims hold neither layout."""
    views, seen = [], set()
    for layer, cache in kv_caches.items():
        if cache.data_ptr() in seen:
            continue
        seen.add(cache.data_ptr())
        if cache.dim() >= 2 and cache.shape[0] == num_blocks:
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
