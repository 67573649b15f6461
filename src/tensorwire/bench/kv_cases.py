"""What ``tensorwire bench kv`` measures: its configuration and its cases, the real layout (``llama70b-tp8``)
included. Plain values without torch, so that the command parses its flags and prints its --help without it;
the measuring is ``kv_rank``, the command ``kv``."""

from __future__ import annotations

from dataclasses import dataclass

from .partial import PartialRecords

__all__ = ["LLAMA", "LLAMA_VIEWS", "LLAMA_BLOCKS", "LLAMA_BLOCK_BYTES", "OPS", "PATTERNS", "KvBenchConfig", "Case",
           "cases"]

LLAMA = "llama70b-tp8"
LLAMA_VIEWS, LLAMA_BLOCKS, LLAMA_BLOCK_BYTES = 160, 512, 4096
OPS = ("READ", "WRITE")
PATTERNS = ("random", "contiguous")


@dataclass(frozen=True)
class KvBenchConfig:
    memory: tuple[str, ...] = ("cpu",)
    blocks: tuple[int, ...] = (1000, 10_000)  # the defaults run in about a minute on 2 cores
    block_bytes: tuple[int, ...] = (16384,)
    ops: tuple[str, ...] = ("READ", "WRITE")
    patterns: tuple[str, ...] = ("random",)  # contiguous ids (one merged NIXL descriptor) on request
    llama: bool = True
    raw: bool = True
    time_s: float = 0.2
    post_reps: int = 20
    timeout_s: float = 1800.0
    quiet: bool = False  # no progress lines on stderr
    partial: PartialRecords | None = None  # where rank 0 adds each case's records as it measures them


@dataclass(frozen=True)
class Case:
    memory: str
    op: str
    pattern: str
    blocks: int
    block_bytes: int  # per view
    views: int = 1
    layout: str = "flat"

    @property
    def nbytes(self) -> int:
        return self.blocks * self.block_bytes * self.views

    def label(self) -> str:
        """``cpu READ random 1000 x 16 KiB`` (and ``x 160 views (llama70b-tp8)``)."""
        views = f" x {self.views} views ({self.layout})" if self.views > 1 else ""
        return f"{self.memory} {self.op} {self.pattern} {self.blocks} x {self.block_bytes // 1024} KiB{views}"


def cases(config: KvBenchConfig, memory: str) -> list[Case]:
    """Every (block bytes, blocks, op, pattern) of ``config``, then the Llama layout's READ (a decode rank pulling a
    prompt's cache: the case a disaggregated server runs; its 82k descriptors make each path slow to time)."""
    out = [Case(memory, op, pattern, n, size) for size in config.block_bytes for n in config.blocks
           for op in config.ops for pattern in config.patterns]
    if config.llama and "READ" in config.ops:
        out.append(Case(memory, "READ", "random", LLAMA_BLOCKS, LLAMA_BLOCK_BYTES, LLAMA_VIEWS, LLAMA))
    return out


# --- pools ------------------------------------------------------------------------------------------------
