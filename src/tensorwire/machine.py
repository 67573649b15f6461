"""Facts about this machine that tensorwire's tools report: software versions, the CPU, CUDA, the host.

``tensorwire doctor`` prints them and ``tensorwire bench`` stamps them into every result's header, so both
read them here. Every call is cheap, starts no process and creates no NIXL agent; a missing component is
reported as None (or with the reason), never raised. Non-goals: deciding what works (the doctor's probes
and ``tw.backends()`` do that).
"""

from __future__ import annotations

import ctypes
import glob
import importlib
import os
import platform
import socket
from pathlib import Path
from typing import Any

__all__ = [
    "nixl_module", "ucx_version", "cpu_model", "cpu_summary", "software_versions", "cuda_summary", "gpu_names",
    "hostname",
]


def nixl_module() -> str | None:
    """The wheel the ``nixl`` meta package picked (``nixl_cu12`` / ``nixl_cu13``), or None if none imports."""
    from .backends.nixl_setup import import_nixl

    try:
        api, _ = import_nixl()
    except Exception:  # noqa: BLE001 - "not importable" is the answer, reported elsewhere with its reason
        return None
    return api.__name__.split(".")[0]


def ucx_version() -> str | None:
    """Version of the UCX that NIXL uses: the ``libucp`` already mapped into this process if any, else the
    one bundled in the nixl wheel's ``.libs`` folder (there is no ``ucx_info`` in the wheel)."""
    candidates = []
    try:
        with open("/proc/self/maps") as maps:
            candidates += sorted({line.split()[-1] for line in maps if "/libucp" in line})
    except OSError:
        pass
    module = nixl_module()
    if module is not None:
        package_dir = Path(importlib.import_module(module).__file__).parent
        candidates += sorted(glob.glob(str(package_dir.parent / f"{module}.libs" / "libucp*.so*")))
    for path in candidates:
        try:
            library = ctypes.CDLL(path)
            library.ucp_get_version_string.restype = ctypes.c_char_p
            return library.ucp_get_version_string().decode()
        except (OSError, AttributeError):
            continue
    return None


def cpu_model() -> str:
    """The CPU's marketing name from ``/proc/cpuinfo``; elsewhere what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_summary() -> dict[str, Any]:
    """``{"model", "cores", "usable_cores"}``: usable cores are those this process may run on (affinity)."""
    return {"model": cpu_model(), "cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0))}


def software_versions() -> dict[str, str | None]:
    """Versions of everything on the data path; None where a component is missing."""
    import torch

    from . import __version__
    from .backends.nixl_setup import _version as nixl_version

    module = nixl_module()
    return {
        "tensorwire": __version__,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "nixl": nixl_version() if module else None,
        "nixl_module": module,
        "ucx": ucx_version() if module else None,
        "python": platform.python_version(),
    }


def cuda_summary() -> tuple[list[str], str]:
    """``(devices, reason)``: one line per visible CUDA device, or why there is none."""
    import torch

    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            return [], f"no CUDA: torch {torch.__version__} is a CPU-only build"
        return [], (f"no CUDA device visible to torch {torch.__version__} (built for CUDA {torch.version.cuda}); "
                    "check the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES")
    devices = []
    for index in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(index)
        devices.append(f"cuda:{index} {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}, "
                       f"{p.multi_processor_count} SMs")
    return devices, f"torch built for CUDA {torch.version.cuda}"


def gpu_names() -> list[str]:
    """The name of every CUDA device torch sees; empty without one."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(index) for index in range(torch.cuda.device_count())]


def hostname() -> str:
    """This host's name, as a report shows it. (Whether two ranks share a host is decided by
    ``memory_map.host_identity``, which adds the boot id: names repeat across containers.)"""
    return socket.gethostname()
