"""``init()``: joining a launcher's world or a fleet, and the ``Communicator`` that comes of it.

The keywords and the environment (``environment.py``) say where to meet: the launcher's store (torchrun,
mpirun, SLURM, or one lent with ``store=``) or a fleet's directory; ``config.py`` supplies the defaults. Both are
checked before torch and the communicator are imported (seconds on a busy machine), so a wrong argument is refused
at once.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from . import config as config_module
from .environment import resolve_environment
from .errors import InvalidArgumentError

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from .communicator import Communicator

__all__ = ["init", "fleet_from_environment"]


def init(
    *,
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    device: torch.device | str | None = None,
    timeout: float | None = None,
    store: dist.Store | None = None,
    directory: str | None = None,
    name: str | None = None,
) -> Communicator:
    """Join the job described by the launcher's environment (torchrun, mpirun, SLURM) or the keywords; or,
    with ``directory="tcp://HOST:PORT"`` and ``name=`` (or ``TENSORWIRE_DIRECTORY`` / ``TENSORWIRE_NAME``), join
    a *fleet*: members launched apart that meet in a directory (``tensorwire directory``, or an etcd cluster:
    ``directory="etcd://HOST:PORT[,HOST:PORT...]"``). A member's rank is
    assigned by the directory (unique for its life, never reused), its name is unique among present members,
    and everything else (register, publish/lookup, prepare, transfers, blocks, notifications, revocation,
    liveness, the job token) works as in a launcher's world. Joining costs O(1) directory operations and no
    connection to anyone; ``members()`` and ``rank_of(name)`` find the others.

    Blocks until rank 0's store is reachable (at most ``timeout`` seconds). Not collective beyond that:
    peers are connected lazily. ``store=`` reuses an existing torch.distributed store (keys are prefixed).
    Calls on it are bounded as on tensorwire's own store (``TENSORWIRE_LIVENESS_S``; a wait: its timeout plus
    that), but tensorwire cannot cut a connection it does not own: each call runs on a helper thread that the
    caller stops waiting for. A call past its bound raises ``PeerLostError``, as does every later store call of
    this communicator; the helper thread stays blocked in the abandoned call (a daemon), and the store object is
    left in whatever state that call leaves it.
    """
    cfg = config_module.load()
    timeout_s = cfg.timeout_s if timeout is None else float(timeout)
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise InvalidArgumentError(f"init: timeout={timeout!r}; give a positive, finite number of seconds")
    if rank is None and world_size is None:  # a fleet's: each of directory and name the environment's if not given
        directory = cfg.directory if directory is None else directory
        name = cfg.name if name is None else name
    env = resolve_environment(rank=rank, world_size=world_size, master_addr=master_addr, master_port=master_port,
                              directory=directory, name=name)
    import torch  # only now: every argument above was checked without it

    from .communicator import Communicator
    from .meeting import meet
    from .shared_memory import remove_orphans

    if device is None:
        if torch.cuda.is_available():
            device = torch.device("cuda", env.local_rank % torch.cuda.device_count())
        else:
            device = torch.device("cpu")
    remove_orphans()  # what killed tensorwire processes of this host left in /dev/shm
    return Communicator(meet(env, cfg, timeout_s, store), torch.device(device), cfg, timeout_s)


def fleet_from_environment() -> tuple[str | None, str | None]:
    """``(directory, name)`` that ``init`` joins a fleet with where its keywords leave them out:
    ``TENSORWIRE_DIRECTORY`` and ``TENSORWIRE_NAME`` (None where unset). For code that needs them before joining,
    e.g. to hand its member name to others."""
    cfg = config_module.load()
    return cfg.directory, cfg.name
