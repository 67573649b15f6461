"""What ``tensorwire bench moe`` measures: its configuration (``MoeBenchConfig``, the defaults of each memory filled
in and checked by ``moe_config``) and why an engine cannot run here (``skip_reason``). Without torch at import, so
that the command parses its flags and prints its --help without it; the measuring is ``moe_rank``, the command
``moe``."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, replace
from typing import Any

from ..backends.nixl_setup import INSTALL_NIXL, nixl_installed
from ..errors import InvalidArgumentError
from .partial import PartialRecords

__all__ = ["DTYPES", "MoeBenchConfig", "skip_reason", "moe_config"]

DTYPES = ("float32", "bfloat16", "float16")  # torch's dtypes of these names


@dataclass(frozen=True)
class MoeBenchConfig:
    """What to measure. ``memory`` "cpu" or "cuda"; None fields take the memory's defaults (see below)."""

    memory: str = "cpu"
    tokens: tuple[int, ...] | None = None  # cpu (128, 512), cuda (128, 4096)
    hidden: int | None = None  # cpu 1024, cuda 7168
    topk: int = 8
    num_experts: int | None = None  # cpu 32, cuda 256 (rounded up to a multiple of world_size)
    engines: tuple[str, ...] | None = None  # cpu ("torch", "nixl"); cuda ("cuda", "nixl", "torch"); minus skipped
    world_size: int = 2
    dtype: str | None = None  # cpu float32, cuda bfloat16
    capacity_factor: float | None = None  # capacity = factor * T * topk rows (None: exact shapes)
    warmup: int = 3
    reps: int = 20
    seed: int = 0
    timeout_s: float = 600.0
    quiet_nixl: bool = True
    graphs: bool = False  # also time the cuda engine's steps captured in CUDA graphs
    skipped: tuple[tuple[str, str], ...] = ()  # (engine, why it cannot run here), filled in by resolved()
    quiet: bool = False  # no progress lines on stderr
    partial: PartialRecords | None = None  # where rank 0 adds each case's records as it measures them

    def resolved(self) -> MoeBenchConfig:
        """Defaults filled in for ``memory``; checked."""
        if self.memory not in ("cpu", "cuda"):
            raise InvalidArgumentError(f"bench moe: memory={self.memory!r}; pass 'cpu' or 'cuda'")
        import torch

        from ..moe.selection import ENGINES

        gpu = self.memory == "cuda"
        if gpu and not torch.cuda.is_available():
            raise InvalidArgumentError(
                f"bench moe: memory='cuda' but torch {torch.__version__} sees no GPU; "
                "pass memory='cpu'"
            )
        requested = self.engines or (("cuda", "nixl", "torch") if gpu else ("torch", "nixl"))
        unknown = sorted(set(requested) - set(ENGINES))
        if unknown:
            raise InvalidArgumentError(f"bench moe: unknown engine(s) {unknown}; pass some of {', '.join(ENGINES)}")
        gpus = torch.cuda.device_count() if gpu else 0
        reasons = {b: skip_reason(b, self.memory, self.world_size, gpus) for b in requested}
        engines = tuple(b for b in requested if reasons[b] is None)
        if not engines:
            raise InvalidArgumentError("bench moe: no requested engine can run here: " + "; ".join(
                f"{b}: {reasons[b]}" for b in requested))
        experts = self.num_experts or (256 if gpu else 32)
        experts = -(-experts // self.world_size) * self.world_size
        config = replace(
            self, tokens=tuple(self.tokens or ((128, 4096) if gpu else (128, 512))),
            hidden=self.hidden or (7168 if gpu else 1024),
            num_experts=experts, engines=engines, dtype=self.dtype or ("bfloat16" if gpu else "float32"),
            skipped=tuple((b, reasons[b]) for b in requested if reasons[b] is not None),
        )
        if config.dtype not in DTYPES:
            raise InvalidArgumentError(f"bench moe: dtype={config.dtype!r}; pass one of {sorted(DTYPES)}")
        if not 1 <= config.topk <= config.num_experts:
            raise InvalidArgumentError(
                f"bench moe: topk={config.topk} must be in [1, "
                f"num_experts={config.num_experts}]"
            )
        if config.world_size < 1 or config.warmup < 0 or config.reps < 1:
            raise InvalidArgumentError("bench moe: world_size >= 1, warmup >= 0 and reps >= 1 are required")
        return config


def skip_reason(engine: str, memory: str, world_size: int, gpu_count: int) -> str | None:
    """Why ``engine`` cannot run ``world_size`` local ranks on ``memory`` ("cpu"/"cuda") of a host with
    ``gpu_count`` GPUs, or None when it can. Ranks take the GPUs in turn, so more ranks than GPUs put two
    ranks on one GPU. Local: no GPU work, no process group is made."""
    if engine == "cuda" and memory != "cuda":
        return "it moves GPU memory only; pass --memory cuda"
    if engine == "nixl" and not nixl_installed():
        return f"nixl is not installed ({INSTALL_NIXL})"
    if engine == "cuda" and importlib.util.find_spec("triton") is None:
        return "Triton is not installed (pip install triton, or tensorwire[cuda])"
    if engine == "torch":
        if memory == "cuda" and world_size > gpu_count:
            return (f"NCCL needs a GPU of its own per rank and {world_size} ranks share {gpu_count} GPU(s); "
                    f"pass --ranks {max(gpu_count, 1)} or fewer to time it")
        import torch

        from ..moe import collectives

        available, reason = collectives.availability(torch.device(memory))
        if not available:
            return reason
    return None


def moe_config(args: Any = None, **overrides: Any) -> MoeBenchConfig:
    """The resolved configuration ``run_moe_bench(args, **overrides)`` runs (see there)."""
    config = args if isinstance(args, MoeBenchConfig) else MoeBenchConfig()
    if args is not None and not isinstance(args, MoeBenchConfig):
        known = {f for f in MoeBenchConfig.__dataclass_fields__}
        config = replace(config, **{k: v for k, v in vars(args).items() if k in known and v is not None})
    config = replace(config, **overrides)
    for name in ("tokens", "engines"):
        value = getattr(config, name)
        if isinstance(value, (str, int)):
            config = replace(config, **{name: (value,)})
    return config.resolved()
