"""Two "hosts" on one machine for tests: two network namespaces joined by a veth pair, one rank in each.

``TwoHosts()`` (root only) creates namespaces ``tw<id>a``/``tw<id>b`` with the addresses ``10.<x>.<y>.1`` and
``.2/30`` on the two ends of a veth pair (nothing is added to the machine's own namespace but the names), and
deletes them on ``close()`` (``with`` closes them, also when the test fails; namespaces left over by a killed
run are named after its process id and deleted by the next run). A rank launched with
``tw.testing.launch`` calls ``hosts.enter(rank)`` first: its process joins its namespace and a UTS namespace of its
own with a different hostname, and ``MASTER_ADDR`` points at rank 0's address, so tensorwire sees two hosts (no
``shm``/``cuda_ipc``; ``nixl`` over TCP). ``cut()`` takes the link down: packets stop both ways with no reset,
as when a cable or switch fails.

``skip_reason()`` says why this cannot run here (not root, no ``ip``, namespaces refused), or None.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import socket
import subprocess

__all__ = ["TwoHosts", "skip_reason"]

_CLONE_NEWNS = 0x00020000
_CLONE_NEWUTS = 0x04000000
_CLONE_NEWNET = 0x40000000
_MS_REC, _MS_SLAVE, _MNT_DETACH = 0x4000, 0x80000, 2


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def skip_reason() -> str | None:
    """Why two network namespaces cannot be made here, or None when they can (probed by making one)."""
    if os.geteuid() != 0:
        return f"needs root to create network namespaces (running as uid {os.geteuid()})"
    if shutil.which("ip") is None:
        return "the 'ip' command (iproute2) is not installed"
    if not os.path.exists("/proc/self/ns/net"):
        return "/proc/self/ns/net is missing: this kernel has no network namespaces"
    name = f"twprobe{os.getpid()}"
    made = _ip("netns", "add", name, check=False)
    if made.returncode != 0:
        return f"'ip netns add' failed: {made.stderr.strip() or made.returncode}"
    _ip("netns", "del", name, check=False)
    return None


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.setns.argtypes, libc.unshare.argtypes = [ctypes.c_int, ctypes.c_int], [ctypes.c_int]
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    return libc


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"TwoHosts.enter: {what} failed: {os.strerror(errno)}")


class TwoHosts:
    """Two network namespaces joined by a veth pair; see the module docstring."""

    def __init__(self) -> None:
        tag = f"tw{os.getpid() % 100000}"
        self.namespaces = (f"{tag}a", f"{tag}b")
        self.links = (f"{tag}a0", f"{tag}b0")
        subnet = os.getpid() % 250
        self.addresses = (f"10.231.{subnet}.1", f"10.231.{subnet}.2")
        self.hostnames = (f"{tag}-host-a", f"{tag}-host-b")
        self._remove()  # left over by an earlier run with this process id
        try:
            for ns in self.namespaces:
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            _ip("link", "add", self.links[0], "netns", self.namespaces[0], "type", "veth", "peer", "name",
                self.links[1], "netns", self.namespaces[1])
            for ns, link, address in zip(self.namespaces, self.links, self.addresses):
                _ip("-n", ns, "addr", "add", f"{address}/30", "dev", link)
                _ip("-n", ns, "link", "set", link, "up")
        except subprocess.CalledProcessError as e:
            self._remove()
            raise RuntimeError(f"TwoHosts: {' '.join(e.cmd)} failed: {e.stderr.strip()}") from e

    def enter(self, rank: int) -> str:
        """In a rank's process, before ``tw.init``: join host ``rank``'s namespace, take its hostname, point
        ``MASTER_ADDR`` at host 0. Returns this host's address."""
        libc = _libc()
        fd = os.open(f"/var/run/netns/{self.namespaces[rank]}", os.O_RDONLY)
        try:
            _check(libc.setns(fd, _CLONE_NEWNET), f"setns into {self.namespaces[rank]}")
        finally:
            os.close(fd)
        _check(libc.unshare(_CLONE_NEWUTS | _CLONE_NEWNS), "unshare(CLONE_NEWUTS | CLONE_NEWNS)")
        socket.sethostname(self.hostnames[rank])
        # As 'ip netns exec' does: /sys of this namespace, or UCX lists the machine's network devices, not these.
        _check(libc.mount(b"none", b"/", None, _MS_REC | _MS_SLAVE, None), "making / a slave mount")
        _check(libc.umount2(b"/sys", _MNT_DETACH), "unmounting /sys")
        _check(libc.mount(self.namespaces[rank].encode(), b"/sys", b"sysfs", 0, None), "mounting sysfs")
        os.environ["MASTER_ADDR"] = self.addresses[0]
        # UCX still sees one machine (one boot id) and would move host memory with process_vm_readv (cma),
        # which no network cut stops; between real hosts it takes TCP.
        os.environ["UCX_TLS"] = "tcp"
        return self.addresses[rank]

    def cut(self) -> None:
        """Take both ends of the link down: from now on nothing passes between the hosts, and nobody is told."""
        for ns, link in zip(self.namespaces, self.links):
            _ip("-n", ns, "link", "set", link, "down", check=False)

    def _remove(self) -> None:
        for ns in self.namespaces:
            _ip("netns", "del", ns, check=False)  # takes its end of the veth pair (and so the pair) along

    def close(self) -> None:
        self._remove()

    def __enter__(self) -> TwoHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict:  # travels to the ranks as an argument
        return dict(self.__dict__)
