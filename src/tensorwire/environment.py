"""Who am I and where do we meet: the launcher's environment (torchrun, OpenMPI, SLURM) or ``init``'s keywords.

Reads ``os.environ`` only (never writes it); no network, no store. ``meeting/`` meets the peers there.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from typing import NamedTuple

from .errors import InvalidArgumentError

__all__ = ["Environment", "resolve_environment", "hostname", "OPEN_WORLD", "parse_directory",
           "DirectoryAddress"]

# A fleet's rank space is open (members come and go; ranks are never reused): its bound where one is needed.
OPEN_WORLD = 2**31 - 1

# (rank, world size, local rank, local world size) variable names per launcher, most specific first.
_LAUNCHERS = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    ("mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
)


@dataclass(frozen=True)
class Environment:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: str
    agent_store: bool = False  # torchrun's agent already hosts a TCPStore at MASTER_ADDR:MASTER_PORT
    name: str | None = None  # a fleet member's name; then master_addr/port are the directory's, rank is assigned
    etcd: tuple[tuple[str, int], ...] = ()  # a fleet's directory in etcd: its endpoints (master_addr/port: the first)
    etcd_user: str | None = None  # the etcd user the URL names (etcd://USER@...); its password is never in a URL
    etcd_tls: bool = False  # the URL asked for TLS (etcds://)

    @property
    def fleet(self) -> bool:
        """A member of a fleet (met in a directory), not a rank of a launcher's fixed world."""
        return self.name is not None


_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:")


class DirectoryAddress(NamedTuple):
    """A parsed ``directory=``: ``scheme`` ``"tcp"`` or ``"etcd"``, its endpoints, and for etcd the user named in
    the URL (``etcd://USER@HOST:PORT``) and whether it asked for TLS (``etcds://``)."""

    scheme: str
    endpoints: tuple[tuple[str, int], ...]
    user: str | None = None
    tls: bool = False


_PASSWORD_WHERE = ("set TENSORWIRE_ETCD_PASSWORD, or TENSORWIRE_ETCD_PASSWORD_FILE naming a file that holds it "
                   "(a password in a URL shows in process lists and logs)")


def parse_directory(directory: str) -> DirectoryAddress:
    """The address of ``tcp://HOST:PORT`` (a ``tensorwire directory``) or of ``etcd://[USER@]HOST:PORT[,HOST:PORT...]``
    (an etcd cluster's client endpoints; ``etcds://`` for TLS); ``InvalidArgumentError`` naming the accepted forms
    otherwise. A password in the URL is refused without being echoed: it belongs in the environment."""
    usage = ("give 'tcp://HOST:PORT' (a 'tensorwire directory') or 'etcd://[USER@]HOST:PORT[,HOST:PORT...]' (etcd's "
             "endpoints; 'etcds://' for TLS)")
    if not isinstance(directory, str) or "://" not in directory:
        shown = _redacted(directory) if isinstance(directory, str) else repr(type(directory))
        raise InvalidArgumentError(f"init: directory={shown!r}; {usage}")
    scheme, _, where = directory.partition("://")
    user = None
    if "@" in where:
        user, _, where = where.rpartition("@")  # a host holds no '@': the user is everything before the last one
        if ":" in user:
            raise InvalidArgumentError(
                f"init: directory='{scheme}://{user.partition(':')[0]}:***@{where}' carries a password; remove it "
                f"from the URL and {_PASSWORD_WHERE}")
        if scheme not in ("etcd", "etcds") or not user:
            raise InvalidArgumentError(f"init: directory={scheme}://...@{where} names a user, which only an etcd "
                                       f"directory takes; {usage}")
    endpoints = []
    for endpoint in where.split(",") if scheme in ("etcd", "etcds") else [where]:
        host, _, port = endpoint.strip().rpartition(":")
        if scheme not in ("tcp", "etcd", "etcds") or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidArgumentError(f"init: directory={_redacted(directory)!r}; {usage}, with ports in 1..65535")
        endpoints.append((host.strip("[]"), int(port)))
    return DirectoryAddress("tcp" if scheme == "tcp" else "etcd", tuple(endpoints), user, scheme == "etcds")


def _redacted(directory: str) -> str:
    """``directory`` as an error may show it: no password, whether after ``user:`` before an ``@`` (with or without
    a scheme), in a query (``?password=...``) or a fragment: everything that could be one is masked."""
    shown = re.sub(r"[?#].*", "?***", directory)
    return re.sub(r"([^/@:]*):[^@]*@", r"\1:***@", shown)


def _launcher_rank() -> int | None:
    """The rank a launcher (torchrun, mpirun, SLURM) gave this process, if one did."""
    for _, r, w, _, _ in _LAUNCHERS:
        if r in os.environ and w in os.environ:
            return _int(os.environ[r], r)
    return None


def _fleet_environment(directory: str, name: str) -> Environment:
    if isinstance(name, str) and "{rank}" in name:  # one TENSORWIRE_NAME for every rank of a launch
        launched = _launcher_rank()
        if launched is None:
            raise InvalidArgumentError(f"init: name={name!r} names {{rank}}, but no launcher (torchrun, mpirun, "
                                       "SLURM) gave this process a rank; give the member's name itself")
        name = name.replace("{rank}", str(launched))
    if not isinstance(name, str) or not 0 < len(name) <= 128 or not set(name) <= _NAME_CHARS:
        raise InvalidArgumentError(
            f"init: name={name!r}; give 1-128 characters of letters, digits and '-_.:' (e.g. 'decode-0')")
    address = parse_directory(directory)
    (host, port) = address.endpoints[0]
    etcd = address.scheme == "etcd"
    return Environment(rank=-1, world_size=OPEN_WORLD, local_rank=0, local_world_size=1, master_addr=host,
                       master_port=port, launcher="fleet", name=name, etcd=address.endpoints if etcd else (),
                       etcd_user=address.user, etcd_tls=address.tls)


def _int(value: str, name: str) -> int:
    # SLURM writes e.g. "4(x2)" for tasks per node.
    head = value.split("(")[0].split(",")[0]
    try:
        return int(head)
    except ValueError:
        raise InvalidArgumentError(f"init: environment variable {name}={value!r} is not an integer") from None


def resolve_environment(
    *,
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    directory: str | None = None,
    name: str | None = None,
) -> Environment:
    """Keyword overrides first, then the first launcher whose variables are set, else a 1-rank world. With a
    ``directory`` (and a ``name``): a fleet member, whose rank the directory assigns at join."""
    if directory is not None or name is not None:
        if directory is None or name is None:
            raise InvalidArgumentError(
                f"init: a fleet member needs both directory= and name= (got directory={directory!r}, name={name!r}); "
                "or set TENSORWIRE_DIRECTORY and TENSORWIRE_NAME")
        if rank is not None or world_size is not None:
            raise InvalidArgumentError("init: rank= and world_size= belong to a launcher's world; a fleet member's "
                                       "rank is assigned by the directory (comm.rank after init)")
        return _fleet_environment(directory, name)
    env = os.environ
    launcher, found = "none", None
    for name, r, w, lr, lw in _LAUNCHERS:
        if r in env and w in env:
            launcher, found = name, (r, w, lr, lw)
            break
    if found:
        r, w, lr, lw = found
        env_rank, env_world = _int(env[r], r), _int(env[w], w)
        env_local_rank = _int(env[lr], lr) if lr in env else env_rank
        env_local_world = _int(env[lw], lw) if lw in env else env_world
    else:
        env_rank, env_world, env_local_rank, env_local_world = 0, 1, 0, 1
    rank = env_rank if rank is None else rank
    world_size = env_world if world_size is None else world_size
    local_rank = env_local_rank if rank == env_rank else rank
    local_world = env_local_world if world_size == env_world else world_size
    if not isinstance(world_size, int) or world_size < 1:
        raise InvalidArgumentError(f"init: world_size={world_size!r}; give an integer >= 1")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise InvalidArgumentError(f"init: rank={rank!r} is outside [0, {world_size}); check RANK and WORLD_SIZE")
    addr = master_addr or env.get("MASTER_ADDR")
    port = master_port if master_port is not None else env.get("MASTER_PORT")
    if world_size > 1 and (not addr or port is None):
        raise InvalidArgumentError(
            f"init: rank {rank} of {world_size} needs a rendezvous address; set MASTER_ADDR and MASTER_PORT "
            "(torchrun does) or pass master_addr=..., master_port=..."
        )
    return Environment(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world,
        master_addr=addr or "127.0.0.1",
        master_port=_int(str(port), "MASTER_PORT") if port is not None else 0,
        launcher=launcher,
        # Like torch.distributed's env:// init: under torchrun every rank is a client of the agent's store.
        agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and master_port is None,
    )


def hostname() -> str:
    return socket.gethostname()
