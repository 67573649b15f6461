"""KV-cache handoffs between serving engines: what every engine adapter needs and none should write again.

A producer (prefill) engine computes a prompt's KV and hands it off; a consumer (decode) engine reads it, once,
whatever the tensor parallelism of either side. Built on ``import tensorwire`` only (fleets, block pools, block
READs, the job token), below the engine adapters (``tensorwire.integrations.vllm``).

    member = kv.KVMember(views, instance="prefill", tp_rank=r, sharding=kv.Sharding(tp, kv_heads), layout=...,
                         block_size=16, order="HND", directory="tcp://HOST:PORT")
    producer = kv.Producer(member, hold_s=120)            # the producer's ranks
    handoff = kv.Handoff(...); producer.hold(handoff)      # params = handoff.to_params(sealed=True) -> client
    ...
    consumer = kv.Consumer(member)                        # the consumer's ranks
    handoff = kv.check_params(params, prompt, block_size, layout, sealed=True, now=time.time())
    consumer.load([kv.Load(request_id, local_ids, handoff, claim=claim)])   # claim: kv.new_claim(), one per load

Modules: handoff.py (the handoff, sealed under one versioned KV wire tag; loads and claims), params.py (the client
form's checks: types, ranges, prompt binding, seal, expiry), heads.py (which producer ranks hold which heads:
intervals, GQA replication, MLA), shapes.py (which rows of which blocks a head range moves, whatever the block sizes
and the orders of the rows: ``BlockShape``, ``BlockPlan``), member.py (a rank's cache in a fleet, as a published
block pool), producer.py (holds granted to one claim, freed after the expected reads, drain), consumer.py (lanes per
producer, claims, head-range READs, reasons for every failure) with sources.py (one producer rank as a lane sees
it), messages.py (claim / grant / done).
"""

from __future__ import annotations

from .consumer import Consumer, LoadFailed, LoadResult
from .handoff import SEAL_CONTEXT, Handoff, Load, member_name, new_claim, prompt_hash
from .heads import HeadMap, HeadRead, Sharding
from .member import POOL_KEY, KVMember
from .params import EXPIRY_MARGIN_S, MAX_BLOCK_ID, HandoffRefused, check_params
from .producer import Producer
from .shapes import ORDERS, BlockPlan, BlockShape

__all__ = ["Consumer", "LoadFailed", "LoadResult", "SEAL_CONTEXT", "Handoff", "Load", "member_name", "new_claim",
           "prompt_hash", "HeadMap", "HeadRead", "Sharding", "POOL_KEY", "KVMember", "EXPIRY_MARGIN_S",
           "MAX_BLOCK_ID", "HandoffRefused", "check_params", "Producer", "BlockShape", "BlockPlan", "ORDERS"]
