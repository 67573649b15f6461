"""The embedded directory: torch's ``TCPStore`` server in a process of its own (``tensorwire directory``).

A fleet's members meet here (``tw.init(directory="tcp://HOST:PORT", name=...)``): it holds their sealed records
(ranks, names, memory maps, liveness addresses) and nothing else. It is the control plane only: transfers go peer
to peer and do not touch it. It listens on ``HOST``'s interface only (``store_sockets.listen_socket``), knows no
token (the values it holds are sealed by the members: it can neither read nor forge them), and keeps nothing on
disk. Non-goals: replication (use etcd where one process is not enough) and surviving its own restart with its
contents.
"""

from __future__ import annotations

import datetime
import signal
import threading

import torch.distributed as dist

from .errors import InvalidArgumentError
from .store_sockets import listen_socket

__all__ = ["Directory"]


class Directory:
    """A running directory: ``address`` is ``tcp://HOST:PORT``; ``close()`` stops it. Context manager."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        listener, why_not = listen_socket(host, port)
        if listener is None:
            raise InvalidArgumentError(f"directory: cannot listen on {host}:{port} ({why_not}); choose another "
                                       "--host (an address of this machine) or --port")
        self.host, self.port = host, listener.getsockname()[1]
        try:
            self._store = dist.TCPStore(host, self.port, None, is_master=True, wait_for_workers=False,
                                        timeout=datetime.timedelta(seconds=30), master_listen_fd=listener.fileno())
        except Exception:
            listener.close()
            raise
        listener.detach()  # the store owns the socket now

    @property
    def address(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    def close(self) -> None:
        self._store = None  # the server thread ends with the store object

    def __enter__(self) -> Directory:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def serve(host: str, port: int, announce=print) -> None:
    """Run a directory until SIGINT/SIGTERM. Blocks."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with Directory(host, port) as directory:
        announce(f"tensorwire directory at {directory.address} (members join with "
                 f"TENSORWIRE_DIRECTORY={directory.address})")
        while not stop.wait(3600):
            pass
