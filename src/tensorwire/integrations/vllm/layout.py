"""The engine's KV cache as a tensorwire block pool, the fingerprint that both instances compare, and how the
model's KV heads are spread over the engine's tensor-parallel ranks.

vLLM allocates one cache tensor per attention layer. Two layouts occur: blocks first (the CPU backend:
``[num_blocks, kv_heads, block_size, 2 * head_dim]``; FlashInfer: ``[num_blocks, 2, ...]``), where block i of the
layer is ``cache[i]``, and K/V first (FlashAttention: ``[2, num_blocks, block_size, kv_heads, head_dim]``), where
it is ``cache[0][i]`` and ``cache[1][i]``. Either way block i of the pool is that block in every layer, so one
request moves a vLLM block of all layers at once. Only the CPU layout holds a block's heads outermost, which reading
across tensor-parallel sizes needs (a head range is one byte range); MLA caches are the same on every rank.
"""

from __future__ import annotations

from typing import Any

import torch

import tensorwire as tw
from tensorwire import kv

__all__ = ["fingerprint", "pool_views", "sharding", "heads_outermost"]


def fingerprint(vllm_config: Any) -> str:
    """What must match between producer and consumer for blocks to be interchangeable, readable in an error
    message: model architecture and KV shape (all heads, not one rank's), cache dtype, block size. Not the tensor
    parallelism (the head map reads across TP sizes), nor the weights (two instances of one architecture with
    different weights have the same layout)."""
    model, cache, parallel = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    architecture = ",".join(getattr(model, "architectures", None) or [type(model.hf_config).__name__])
    dtype = model.dtype if cache.cache_dtype in (None, "auto") else cache.cache_dtype
    attention = "mla" if getattr(model, "use_mla", False) else f"kv_heads={model.get_total_num_kv_heads()}"
    return (f"{architecture} layers={model.get_num_layers(parallel)} {attention} head_dim={model.get_head_size()} "
            f"kv_dtype={str(dtype).removeprefix('torch.')} block_size={cache.block_size}")


def sharding(vllm_config: Any) -> kv.Sharding:
    """The engine's KV heads over its tensor-parallel ranks: MLA's latent cache is whole on every rank."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    if getattr(model, "use_mla", False):
        return kv.Sharding(parallel.tensor_parallel_size, 1, replicated=True)
    return kv.Sharding(parallel.tensor_parallel_size, model.get_total_num_kv_heads())


def heads_outermost(kv_caches: dict[str, torch.Tensor], num_blocks: int, local_heads: int) -> bool:
    """Whether every cache is the CPU backend's ``[num_blocks, kv_heads, block_size, 2 * head_dim]``: a block's
    heads outermost, so a range of heads is one byte range of the block. Told by the device as well as the shape:
    a GPU backend's 4-D cache may put the tokens first with as many tokens per block as heads."""
    return all(c.device.type == "cpu" and c.dim() == 4 and c.shape[0] == num_blocks and c.shape[1] == local_heads
               for c in kv_caches.values())


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
