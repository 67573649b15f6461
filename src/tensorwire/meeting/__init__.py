"""Where ranks meet: a launcher's world or a fleet, two types behind one interface (``Rendezvous``).

* ``World`` (``world.py``): ranks ``0..world_size-1`` known at start, meeting in torch's ``TCPStore`` that rank 0
  hosts (torchrun, mpirun, SLURM, or ``init``'s keywords; or a store lent to ``init``).
* ``Fleet`` (``fleet.py``): members launched apart, meeting in a directory, each under a name: the embedded one
  (``directory.py``, reached through ``directory_store.py`` over ``directory_wire.py``) or etcd (``etcd_store.py``);
  ``membership.py`` holds names, records, ``members()`` and ``rank_of()``.

Both are a ``Rendezvous`` (``rendezvous.py``: sealed values, bounded store calls, waits, rank claims) with a
``Liveness`` view of their peers (``liveness.py``, ``listener_queries.py``, ``peer_sockets.py``). What differs is
answered by the type, never by a flag: how the store is reached, who hosts it, ``barrier``, ``world_size``,
``members``/``rank_of``, how a rank starts and departs. The communicator above sees ``Rendezvous`` only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import InvalidArgumentError

if TYPE_CHECKING:
    import torch.distributed as dist

    from ..config import Config
    from ..environment import Environment
    from .rendezvous import Rendezvous

__all__ = ["Rendezvous", "World", "Fleet", "meet"]

# Imported on first use: the embedded directory (``tensorwire directory``, directory.py) needs no torch, and a
# package that imported World and Fleet here would load it into every directory process.
_LAZY = {"Rendezvous": ".rendezvous", "World": ".world", "Fleet": ".fleet"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def meet(env: Environment, cfg: Config, timeout_s: float, store: dist.Store | None) -> Rendezvous:
    """The meeting point of ``env``: a fleet's directory, or the launcher's store (or the one lent to ``init``).
    Blocks until it is reached (at most ``timeout_s``)."""
    from .etcd_access import etcd_access
    from .fleet import Fleet
    from .world import World

    if not env.fleet:
        return World(env, timeout_s, store, token=cfg.job_token, liveness_s=cfg.liveness_s)
    if store is not None:
        raise InvalidArgumentError("init: store= and directory= are two ways to meet; give one")
    access = etcd_access(env.etcd_user, env.etcd_tls, user=cfg.etcd_user, password=cfg.etcd_password, ca=cfg.etcd_ca,
                         cert=cfg.etcd_cert, key=cfg.etcd_key) if env.etcd else None
    return Fleet(env, timeout_s, token=cfg.job_token, liveness_s=cfg.liveness_s, etcd_access=access)
