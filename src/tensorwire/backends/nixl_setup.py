"""Getting a NIXL agent: importing ``nixl`` (typed errors for what is missing), whether its UCX backend starts here
(``info``), NIXL's log lines (demoted to DEBUG), and the agent built with a sleeping progress thread
(``make_agent``), and UCX's start-up options (``UCX_START_DEFAULTS``). No transfers: ``backends/nixl.py`` uses
what is made here.

UCX's start-up options. UCX reads its memory-hook options once, from the process environment, when NIXL loads it;
nothing NIXL passes later (its engine configuration) reaches them. UCX >= 1.21 patches each hooked function in place
and spins a grace window (50 ms) per function before finishing it; a thread that enters a function while it is
patched spins with it, and one that enters it past the window crashes. With the defaults ``UCX_START_DEFAULTS``
names (no memory events, no registration cache), set here before the first ``import nixl`` for every variable the
user has not set, UCX patches nothing (an H100 host: ``nixl_agent()`` 0.02-0.05 s instead of 1.2 s; what UCX gives
up is in docs/architecture.md, "Start-up on a GPU host"). This is the one place the library writes the process
environment: UCX offers no other way in, and the variables are inherited by the processes this one starts (the
same defaults on every rank a launcher spawns).
``TENSORWIRE_UCX_DEFAULTS=0`` (``config.ucx_defaults_enabled``) leaves the environment alone; a variable the user
set always wins. ``ucx_start_options()`` says what is in effect and who set it (``tensorwire doctor`` prints it).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from typing import Any

from ..config import ucx_defaults_enabled
from ..errors import BackendUnavailableError
from .base import BackendInfo

__all__ = ["info", "quiet_nixl_logging", "import_nixl", "make_agent", "INSTALL_NIXL", "nixl_installed",
           "UCX_START_DEFAULTS", "ucx_start_options"]

INSTALL_NIXL = "pip install 'tensorwire[nixl]'"


def nixl_installed() -> bool:
    """Whether a ``nixl`` package is there to import (not whether it works: ``info``)."""
    return importlib.util.find_spec("nixl") is not None


class _DemoteInfo(logging.Filter):
    """On NIXL's ``nixl`` logger: its informational lines ("Initialized NIXL agent", "Backend UCX was
    instantiated", one pair per rank) leave it and go to ``tensorwire.nixl`` at DEBUG instead; warnings and
    errors stay. NIXL attaches a stdout handler to its logger on import, so without this every program prints
    them (users read them as failures)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        logging.getLogger("tensorwire.nixl").debug("%s", record.getMessage())
        return False


_DEMOTE_INFO = _DemoteInfo()


# UCX's start-up options set where the user has not (see the module docstring). Measured against UCX's defaults,
# UCX_MEMTYPE_CACHE=n and UCX_MEM_MMAP_HOOK_MODE=reloc in docs/architecture.md ("Start-up on a GPU host").
UCX_START_DEFAULTS: dict[str, str] = {"UCX_MEM_EVENTS": "n", "UCX_RCACHE_ENABLE": "n"}

_set_by_us: dict[str, str] = {}  # the defaults this process set, for doctor
_loaded_before_us = False  # NIXL was imported before tensorwire could set them: UCX read the environment already
_decided = False  # the first import_nixl of this process has looked (later ones change nothing)


def _set_ucx_start_defaults() -> None:
    """Set each of ``UCX_START_DEFAULTS`` the environment does not name, once, before NIXL (and UCX) first load."""
    global _loaded_before_us, _decided
    if _decided:
        return
    _decided = True
    if "nixl._api" in sys.modules or "nixl" in sys.modules:
        _loaded_before_us = any(k not in os.environ for k in UCX_START_DEFAULTS)
        return
    if not ucx_defaults_enabled():
        return
    for name, value in UCX_START_DEFAULTS.items():
        if name not in os.environ:
            os.environ[name] = value  # the library's one write of the environment: see the module docstring
            _set_by_us[name] = value


def ucx_start_options() -> list[tuple[str, str, str]]:
    """``(variable, value in effect, who set it)`` for each of ``UCX_START_DEFAULTS``: ``"tensorwire"``, ``"user"``,
    or ``"unset"`` (the defaults are off, or NIXL was loaded before tensorwire could set them)."""
    rows = []
    for name in UCX_START_DEFAULTS:
        value = os.environ.get(name)
        if value is None:
            rows.append((name, "(UCX's default)", "unset: NIXL loaded before tensorwire" if _loaded_before_us
                         else "unset"))
        else:
            rows.append((name, value, "tensorwire" if _set_by_us.get(name) == value else "user"))
    return rows


def import_nixl() -> tuple[Any, Any]:
    """``(nixl._api, nixl._bindings)``, or ``BackendUnavailableError`` saying why not. The first call sets UCX's
    start-up defaults where the user has not (module docstring). NIXL's INFO lines are demoted to DEBUG on
    ``tensorwire.nixl`` (``_DemoteInfo``)."""
    _set_ucx_start_defaults()
    try:
        api = importlib.import_module("nixl._api")
        bindings = importlib.import_module("nixl._bindings")
    except ModuleNotFoundError as e:
        if e.name in ("nixl", "nixl._api", "nixl._bindings"):
            raise BackendUnavailableError(
                f"nixl: the 'nixl' package is not installed; {INSTALL_NIXL} (pulls nixl-cu12/nixl-cu13). Without it "
                "ranks reach each other on one host only (shm, cuda_ipc)"
            ) from e
        raise BackendUnavailableError(
            f"nixl: importing nixl failed because its dependency {e.name!r} is missing; install it"
        ) from e
    except ImportError as e:
        raise BackendUnavailableError(
            f"nixl: importing nixl failed ({e}); reinstall nixl matching your CUDA major version "
            "(nixl-cu12 or nixl-cu13)"
        ) from e
    for handler in logging.getLogger("nixl").handlers:  # NIXL's modules log on child loggers: filter the handler
        if _DEMOTE_INFO not in handler.filters:
            handler.addFilter(_DEMOTE_INFO)
    return api, bindings


def info() -> BackendInfo:
    """Whether NIXL with its UCX plugin can be used here (no agent is left behind)."""
    try:
        api, _ = import_nixl()
    except BackendUnavailableError as e:
        return BackendInfo("nixl", False, str(e), fix=INSTALL_NIXL)
    version = _version()
    try:
        probe = api.nixl_agent("tensorwire-probe", api.nixl_agent_config(enable_prog_thread=False, backends=[]))
        plugins = probe.get_plugin_list()
    except Exception as e:  # noqa: BLE001 - any failure here means "unavailable", reported with its text
        return BackendInfo("nixl", False, f"creating a NIXL agent failed: {e}", fix="check the nixl install",
                           version=version)
    if "UCX" not in plugins:
        return BackendInfo(
            "nixl", False, f"NIXL has no UCX plugin (found {plugins})",
            fix="reinstall nixl; set NIXL_PLUGIN_DIR if plugins live elsewhere", version=version,
        )
    try:  # the plugin loading is not enough: UCX must find usable transports with this environment
        probe.create_backend("UCX", {"ucx_error_handling_mode": "peer", "num_workers": "1"})
    except Exception as e:  # noqa: BLE001
        return BackendInfo(
            "nixl", False, f"NIXL could not start its UCX backend ({type(e).__name__}: {e}); UCX found no usable "
            "transport", fix="unset or widen UCX_TLS / UCX_NET_DEVICES (UCX needs a host transport such as "
            "tcp or shared memory); 'tensorwire doctor' lists the UCX variables in effect", version=version,
        )
    return BackendInfo("nixl", True, "UCX backend starts", version=version)


def quiet_nixl_logging() -> None:
    """Keep NIXL's Python INFO lines ("Initialized NIXL agent ...") off stdout in this process.

    NIXL configures its ``nixl`` logger on import (INFO, a handler on stdout), so it must be imported before
    it is adjusted; warnings still show, on stderr. For command-line tools (``tensorwire doctor`` / ``bench``)
    and the ranks they launch: the library itself leaves logging alone. Does nothing when NIXL does not
    import (the doctor reports why).
    """
    try:
        import_nixl()
    except BackendUnavailableError:
        return
    logger = logging.getLogger("nixl")
    logger.setLevel(logging.WARNING)
    for handler in logger.handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("nixl", "nixl-cu13", "nixl-cu12"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "unknown"


def _error_classes(bindings: Any) -> frozenset[str]:
    return frozenset(n for n in dir(bindings) if n.startswith("nixl") and n.endswith("Error"))


def make_agent(api: Any, bindings: Any, name: str, progress_wakeup_ms: float, sync_mode: str = "STRICT",
                net_devices: str | None = None) -> Any:
    """A ``nixl_agent`` whose UCX progress thread sleeps between events instead of spinning.

    ``sync_mode`` is NIXL's thread-synchronisation mode (``"NONE"``, ``"RW"`` or ``"STRICT"``); ``net_devices``
    restricts the network devices UCX uses (its ``NET_DEVICES`` setting, handed to the engine, not the process
    environment)."""
    agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=True, backends=[]))
    config = bindings.nixlAgentConfig()
    config.useProgThread = True
    config.useListenThread = False
    config.syncMode = getattr(bindings, f"NIXL_THREAD_SYNC_{sync_mode}")
    config.pthrDelay = int(max(progress_wakeup_ms, 1.0) * 1000)  # microseconds
    config.captureTelemetry = False
    # Swap in the bindings agent before any backend exists, so that the UCX engine and its progress
    # thread are created with our config; every nixl_agent method goes through ``agent.agent``.
    agent.agent = bindings.nixlAgent(name, config)
    params = {"ucx_error_handling_mode": "peer", "num_workers": "1"}
    if net_devices:
        params["engine_config"] = f"NET_DEVICES={net_devices}"
    agent.create_backend("UCX", params)
    return agent
