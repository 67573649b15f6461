"""Which network devices this rank's UCX may listen on: the interface the job meets on, and RDMA ports.

UCX's TCP transport listens on every interface by default, the host's external address included, although
the job may meet on loopback or one private network (``MASTER_ADDR``). ``ucx_net_devices(address)`` names the
interface that owns ``address`` (this rank's address on the route to the store: ``store_sockets.local_address``)
plus every RDMA device port of the host (InfiniBand/RoCE: leaving them out would drop UCX to TCP, and they take
no connection from a peer that lacks the remote keys in our sealed metadata). Reads ``/sys`` and the kernel's
interface table; no configuration is written anywhere (the caller hands the list to UCX).

Non-goals: IPv6-only interfaces are not matched (UCX is then left unrestricted, and the doctor says so).
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct

__all__ = ["interface_of", "rdma_ports", "ucx_net_devices"]

_SIOCGIFADDR = 0x8915
_SYS_INFINIBAND = "/sys/class/infiniband"


def interface_of(address: str) -> str | None:
    """The name of the local interface whose IPv4 address is ``address``, or None (no such interface, IPv6)."""
    try:
        wanted = socket.inet_aton(address)
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on it
            if answer[20:24] == wanted:
                return name
    return None


def rdma_ports() -> list[str]:
    """UCX's names (``device:port``) of this host's RDMA ports, sorted; empty where there are none."""
    try:
        devices = sorted(os.listdir(_SYS_INFINIBAND))
    except OSError:
        return []
    ports = []
    for device in devices:
        try:
            ports += [f"{device}:{port}" for port in sorted(os.listdir(os.path.join(_SYS_INFINIBAND, device, "ports")))]
        except OSError:
            continue
    return ports


def ucx_net_devices(address: str) -> tuple[str | None, str]:
    """``(UCX_NET_DEVICES value, why)``: the job's interface and the RDMA ports, or None with the reason where the
    interface cannot be told (UCX then listens everywhere, as it does by default)."""
    interface = interface_of(address)
    if interface is None:
        return None, f"no local IPv4 interface has the job's address {address}"
    devices = [interface, *rdma_ports()]
    return ",".join(devices), f"UCX listens on {interface} ({address}) only" + (
        f", RDMA on {', '.join(devices[1:])}" if len(devices) > 1 else "")
