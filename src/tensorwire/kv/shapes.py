"""Where a KV row lives inside a block, and which byte ranges of which blocks one head range of a request moves,
whatever the block sizes and token/head orders of the two engines.

A view's block (one layer's K, say) holds ``block_size`` tokens x ``heads`` KV heads (the rank's) of *rows*: one
head of one token, ``head_bytes`` long (``head_dim`` elements). Three orders occur:

- ``HND``, heads outermost: row ``(t, h)`` is row ``h * block_size + t``; a range of heads is one run of the block.
  vLLM asks GPU engines for it (NixlConnector's ``get_required_kvcache_layout``).
- ``NHD``, tokens outermost: row ``(t, h)`` is row ``t * heads + h``; a range of heads is one run per token.
  FlashAttention's and FlashInfer's default.
- ``HKND``, vLLM's CPU backend: one view holds K and V, each head its K rows then its V rows: row ``(t, h, kv)`` is
  row ``(h * 2 + kv) * block_size + t`` as far as a head range goes. Inside a head its kernels pack the rows for
  the machine's vector unit (AMX, AVX-512...), so only whole heads of blocks of one size pair, and only with
  another ``HKND`` block (the other orders keep K and V in views of their own).

A ``BlockPlan`` pairs a consumer rank's blocks with a producer rank's for one ``HeadRead``. With block sizes ``Bc``
(consumer) and ``Bp`` (producer), one of which divides the other (``ratio`` = the larger / the smaller), the request
moves in ``ratio`` *parts*; part ``k`` pairs ``T = min(Bc, Bp)`` tokens:

- ``Bc = Bp``: one part, whole blocks (consumer block ``i`` <- producer block ``i``);
- ``Bc > Bp``: consumer block ``i``'s tokens ``[k*Bp, (k+1)*Bp)`` <- producer block ``i*ratio + k`` (a consumer
  block is filled from several producer blocks; sub-blocks past the prompt's last producer block are not read);
- ``Bc < Bp``: consumer block ``i`` <- producer block ``i // ratio``'s tokens ``[k*Bc, (k+1)*Bc)`` for ``k = i %
  ratio`` (a producer block feeds several consumer blocks; its tail past the prompt's last consumer block is never
  read).

Inside a part, a row of the consumer's block pairs with the producer's row of the same token and head; rows
consecutive on both sides merge into one *range* ``(local row, remote row, rows)``. Same order, same block size,
whole blocks: one range. ``HND`` both sides: one range per part. ``NHD`` with a head split: ``T`` ranges (one per
token). Orders that differ: a range per row (``T x heads``): correct, and as many descriptors per block.

Indices are block positions in token order (a request's consumer blocks ``[h, m)``, ``h`` the ones its own prefix
cache holds); ``pairs`` turns them into block ids. Scope: arithmetic, no tensors, no I/O, nothing blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tensorwire import InvalidArgumentError

from .heads import HeadRead

__all__ = ["BlockShape", "BlockPlan", "ORDERS", "MAX_BLOCK_SIZE", "MAX_BLOCK_RATIO"]

ORDERS = ("HND", "NHD", "HKND")
MAX_BLOCK_SIZE = 1 << 16  # tokens per block; past it a peer's value is refused before any arithmetic
MAX_BLOCK_RATIO = 64  # the larger block size over the smaller: as many parts, each a prepared READ per source


@dataclass(frozen=True)
class BlockShape:
    """One engine rank's block: ``block_size`` tokens x ``heads`` KV heads of rows, in ``order`` (``ORDERS``).
    Construction raises ``InvalidArgumentError`` for anything else (a value from a peer is checked here too)."""

    block_size: int
    heads: int
    order: str = "HND"

    def __post_init__(self) -> None:
        for name, value, high in (("block_size", self.block_size, MAX_BLOCK_SIZE), ("heads", self.heads, 1 << 16)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
                raise InvalidArgumentError(f"BlockShape: {name}={value!r}; give an int in [1, {high}]")
        if self.order not in ORDERS:
            raise InvalidArgumentError(f"BlockShape: order={self.order!r}; give 'HND' (heads outermost in a block), "
                                       "'NHD' (tokens outermost) or 'HKND' (vLLM's CPU cache: per head K then V)")

    @property
    def halves(self) -> int:
        """2 where the view holds K and V (``HKND``), else 1 (K and V are views of their own)."""
        return 2 if self.order == "HKND" else 1

    @property
    def rows(self) -> int:
        return self.block_size * self.heads * self.halves

    def row(self, tokens: np.ndarray, heads: np.ndarray, halves: np.ndarray) -> np.ndarray:
        """The row index of ``(token, head, K/V half)`` for arrays of equal shape (``halves`` all 0 unless
        ``HKND``)."""
        if self.order == "HND":
            return heads * self.block_size + tokens
        if self.order == "HKND":
            return (heads * 2 + halves) * self.block_size + tokens
        return tokens * self.heads + heads


@dataclass(frozen=True)
class Part:
    """Part ``index`` of a plan: its ranges ``(local row, remote row, rows)`` inside a block pair."""

    index: int
    ranges: tuple[tuple[int, int, int], ...]


@dataclass(frozen=True)
class BlockPlan:
    """How consumer blocks of shape ``local`` read ``read``'s heads from producer blocks of shape ``remote``.
    Construction raises ``InvalidArgumentError`` for block sizes of which neither divides the other."""

    local: BlockShape
    remote: BlockShape
    read: HeadRead

    def __post_init__(self) -> None:
        small, large = sorted((self.local.block_size, self.remote.block_size))
        if large % small or large // small > MAX_BLOCK_RATIO:
            raise InvalidArgumentError(
                f"BlockPlan: consumer blocks of {self.local.block_size} tokens and producer blocks of "
                f"{self.remote.block_size}: {'neither divides the other' if large % small else 'too far apart'}; "
                f"run block sizes where one is a multiple of the other, at most {MAX_BLOCK_RATIO} times it (16, "
                "32, 64, 128...)")
        if self.local.halves != self.remote.halves:
            raise InvalidArgumentError(
                f"BlockPlan: a consumer block in {self.local.order} and a producer block in {self.remote.order}: "
                "vLLM's CPU cache (HKND, K and V in one view) pairs only with another CPU cache; run both engines "
                "on the same kind of device")
        if self.local.order == "HKND" and small != large:
            raise InvalidArgumentError(
                f"BlockPlan: vLLM CPU caches (HKND) of {self.local.block_size}- and {self.remote.block_size}-token "
                "blocks: the CPU kernels pack a head's rows per block, so only blocks of one size pair; start both "
                "engines with the same --block-size")
        read = self.read
        if read.local_offset + read.num_heads > self.local.heads or read.remote_offset + read.num_heads > \
                self.remote.heads:
            raise InvalidArgumentError(
                f"BlockPlan: heads [{read.remote_offset}, +{read.num_heads}) of a producer block of "
                f"{self.remote.heads} heads into [{read.local_offset}, +{read.num_heads}) of a consumer block of "
                f"{self.local.heads}; the head map and the shapes disagree")

    @property
    def ratio(self) -> int:
        """The larger block size over the smaller: how many parts a request moves in."""
        return max(self.local.block_size, self.remote.block_size) // min(self.local.block_size,
                                                                           self.remote.block_size)

    @property
    def whole(self) -> bool:
        """Whole blocks on both sides, one part: the pools themselves pair, nothing derived."""
        return self.parts()[0].ranges == ((0, 0, self.local.rows),) and self.local.rows == self.remote.rows

    def parts(self) -> list[Part]:
        return [self._part(k) for k in range(self.ratio)]

    def _part(self, k: int) -> Part:
        local, remote, read = self.local, self.remote, self.read
        tokens_per_part = min(local.block_size, remote.block_size)
        local_base = k * tokens_per_part if local.block_size > remote.block_size else 0
        remote_base = k * tokens_per_part if remote.block_size > local.block_size else 0
        tokens, heads, halves = np.meshgrid(np.arange(tokens_per_part), np.arange(read.num_heads),
                                            np.arange(local.halves), indexing="ij")
        local_rows = local.row(tokens + local_base, heads + read.local_offset, halves).ravel()
        remote_rows = remote.row(tokens + remote_base, heads + read.remote_offset, halves).ravel()
        order = np.argsort(local_rows, kind="stable")
        local_rows, remote_rows = local_rows[order], remote_rows[order]
        # A range ends where either side's next row is not the next one.
        breaks = np.flatnonzero((np.diff(local_rows) != 1) | (np.diff(remote_rows) != 1)) + 1
        starts = np.concatenate(([0], breaks))
        lengths = np.diff(np.concatenate((starts, [len(local_rows)])))
        return Part(k, tuple(zip(local_rows[starts].tolist(), remote_rows[starts].tolist(), lengths.tolist())))

    def pairs(self, k: int, local_ids: np.ndarray, remote_ids: np.ndarray,
              num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """Part ``k``'s ``(local ids, remote ids)`` for one request of ``num_tokens`` tokens: ``remote_ids`` are all
        the producer's blocks of the prompt in token order, ``local_ids`` the consumer's last blocks (those its
        prefix cache does not hold). Raises ``InvalidArgumentError`` when the counts do not fit the prompt."""
        consumer_blocks = math.ceil(num_tokens / self.local.block_size)
        if len(remote_ids) != math.ceil(num_tokens / self.remote.block_size) or len(local_ids) > consumer_blocks:
            raise InvalidArgumentError(
                f"BlockPlan.pairs: {len(local_ids)} consumer and {len(remote_ids)} producer blocks for {num_tokens} "
                f"tokens in blocks of {self.local.block_size} and {self.remote.block_size}; give at most "
                f"{consumer_blocks} consumer blocks and exactly {math.ceil(num_tokens / self.remote.block_size)} "
                "producer blocks")
        positions = np.arange(consumer_blocks - len(local_ids), consumer_blocks)  # consumer blocks in token order
        ratio = self.ratio
        if self.local.block_size >= self.remote.block_size:
            sources = positions * ratio + k
            keep = sources < len(remote_ids)
        else:
            sources = positions // ratio
            keep = positions % ratio == k
        local_ids, remote_ids = np.asarray(local_ids, dtype=np.int64), np.asarray(remote_ids, dtype=np.int64)
        return local_ids[keep], remote_ids[sources[keep]]
