"""``tensorwire doctor``: what works on this machine, what does not, why, and what to do.

It reports, in order: software versions (UCX's too, read from the library NIXL bundles); the backends
table; the CUDA devices; the job (its token, where UCX listens, and the fleet's directory when
``TENSORWIRE_DIRECTORY`` names one: whether it answers there); the ``/dev/shm`` files dead tensorwire processes
left (removed, as every tensorwire process on the host does); which UCX transport a host-to-host and a
GPU-to-GPU transfer really take here, and whether NIXL really moves CUDA memory as VRAM (registration, then a
2-process transfer whose bytes are checked: some UCX builds silently treat VRAM as host memory). The last two
come from ``doctor_probe``, whose two processes meet in a job of their own (never the fleet's directory); a
probe that fails before its ranks met is not blamed on UCX.

Every probe is bounded in time, and a failing probe is reported, never raised: the doctor exits 0 whenever
it could diagnose. Non-goals: fixing anything but dead processes' files, benchmarking (``tensorwire bench``
does that). The machine facts it prints come from ``tensorwire.machine``.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field

# cpu_model, ucx_version, ProtoRow and parse_proto_info are only re-exported: they lived here before.
from . import config
from .backends.base import BackendInfo
from .doctor_probe import ProbeResult, run_probe
from .machine import cpu_model, cuda_summary, software_versions, ucx_version
from .ucx_protocols import ProtoRow, parse_proto_info

__all__ = [
    "ProtoRow", "parse_proto_info", "ProbeResult", "run_probe", "software_versions", "cpu_model",
    "cuda_summary", "ucx_version", "diagnose",
]

_FLEET_CONNECT_S = 5.0  # a directory on a loaded host accepts within this; nothing listening refuses at once
_TCP_ONLY_FIX = {
    "host": "UCX found no shared-memory path between the two processes. cma needs ptrace permission between "
            "them (/proc/sys/kernel/yama/ptrace_scope 0 or 1 with the same user; in a container add "
            "--cap-add SYS_PTRACE); also check that UCX_TLS, if set, keeps cma or sm",
    "cuda": "UCX found no cuda_ipc path between the two processes. Give both the same GPUs and IPC namespace "
            "(docker --ipc=host, same CUDA_VISIBLE_DEVICES), keep cuda_ipc in UCX_TLS if set, and install the "
            "nixl wheel of your CUDA major (nixl-cu12 or nixl-cu13)",
}


def _report_ucx_binding(report: Report) -> None:
    """Which interfaces a rank's UCX would listen on, for a job meeting at MASTER_ADDR (127.0.0.1 if unset)."""
    from .network import ucx_net_devices

    if "UCX_NET_DEVICES" in os.environ:
        report.line(f"UCX_NET_DEVICES={os.environ['UCX_NET_DEVICES']} is set: UCX listens where it says "
                    "(tensorwire leaves it alone)")
        return
    address = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        address = socket.getaddrinfo(address, None, socket.AF_INET)[0][4][0]
    except OSError:
        pass
    devices, why = ucx_net_devices(address)
    if devices is None:
        report.loud("WARN", f"UCX will listen on every interface: {why}",
                    "set MASTER_ADDR to this host's IPv4 address on the network the ranks share, or UCX_NET_DEVICES")
    else:
        report.line(f"UCX bound to one interface: {why} (UCX_NET_DEVICES={devices} for a job at {address})")


# --- the report ---------------------------------------------------------------------------------------
@dataclass
class Report:
    """Lines to print and the problems found; ``emit`` is called as each section is ready."""

    emit: Callable[[str], None]
    problems: list[str] = field(default_factory=list)

    def section(self, title: str) -> None:
        self.emit("")
        self.emit(title)

    def line(self, text: str) -> None:
        self.emit(f"  {text}")

    def loud(self, level: str, text: str, fix: str = "") -> None:
        """A problem nobody should miss: a banner line, the reason and the fix."""
        self.problems.append(f"{level}: {text}")
        self.emit(f"  !!! {level}: {text}")
        if fix:
            self.emit(f"  !!! fix: {fix}")


def diagnose(emit: Callable[[str], None] = print, timeout_s: float = 15.0, quiet: bool = True,
             clean: bool = True) -> Report:
    """Run every check, printing through ``emit`` as it goes; returns the report (problems listed). Removes the
    ``/dev/shm`` files that tensorwire processes gone since left (``clean=False``: only counts them)."""
    report = Report(emit)
    emit("tensorwire doctor")
    versions = software_versions()
    _report_versions(report, versions)
    nixl_ok = _report_backends(report)
    _report_vllm(report, nixl_ok)
    _report_ucx_start(report, nixl_ok)
    has_devices = _report_cuda(report, versions)
    _report_job(report)
    _report_leftovers(report, clean)  # before the probes: their tw.init would remove the files unreported
    cuda = _report_transports(report, timeout_s, quiet, nixl_ok, has_devices)
    report.section("NIXL VRAM")
    _report_vram(report, cuda, nixl_ok)
    _report_verdict(report)
    return report


def _report_versions(report: Report, versions: dict) -> None:
    report.section("versions")
    for name in ("tensorwire", "torch", "nixl", "ucx", "python"):
        value = versions[name] or "not found"
        if name == "torch":
            value += f" (CUDA {versions['torch_cuda']})" if versions["torch_cuda"] else " (CPU-only build)"
        if name == "nixl" and versions["nixl_module"]:
            value += f" (loaded {versions['nixl_module']})"
        report.line(f"{name:<11}{value}")


def _report_backends(report: Report) -> bool:
    """The backends table, and whether the nixl backend is available (the probes need it)."""
    from . import backends
    from .backends.nixl_setup import INSTALL_NIXL, nixl_installed

    infos = backends()
    report.section("backends")
    _table(report, ["backend", "available", "version", "reason", "fix"],
           [[i.name, _availability(i), i.version or "-", i.reason, i.fix or "-"] for i in infos.values()])
    if not nixl_installed():  # an extra: a job of one host runs without it
        report.loud("WARN", "nixl is not installed: ranks reach each other on this host only, over shm (host "
                    "memory from tw.shared_empty) and cuda_ipc", INSTALL_NIXL)
    elif not infos["nixl"].available:
        report.loud("FAIL", f"backend nixl is unavailable: {infos['nixl'].reason}", infos["nixl"].fix)
    return infos["nixl"].available


def _report_vllm(report: Report, nixl_ok: bool) -> None:
    """Where vLLM is installed: whether its TensorwireConnector can carry a KV cache to a peer instance (the
    connector's worker says the same at start-up). vLLM is found, not imported (seconds)."""
    if importlib.util.find_spec("vllm") is None:
        return
    report.section("vLLM")
    if nixl_ok:
        report.line("TensorwireConnector: NIXL carries KV caches between instances (host or GPU memory, any host)")
        return
    report.loud("WARN", "vLLM is installed here but NIXL is not usable: a TensorwireConnector's KV cache in host "
                "memory (vLLM's CPU build) reaches no peer, nor does GPU memory on another host, so every load "
                "fails (recomputed behind successful answers)", "pip install nixl in this environment, the one that "
                "runs vLLM")


def _availability(info: BackendInfo) -> str:
    """The table's word for a backend: "yes", "no" (there is something to fix), or "not used" (unavailable and
    nothing to fix: another backend does its job here, as NIXL does the socket channel's)."""
    return "yes" if info.available else ("no" if info.fix else "not used")


def _report_ucx_start(report: Report, nixl_ok: bool) -> None:
    """UCX's start-up options in this process, and who set them (``nixl_setup.UCX_START_DEFAULTS``): tensorwire's
    defaults, the user's value, or neither."""
    from .backends.nixl_setup import ucx_start_options

    if not nixl_ok:
        return
    report.section("UCX start-up options (read once, when NIXL loads UCX)")
    _table(report, ["variable", "value", "set by"], [list(row) for row in ucx_start_options()])
    report.line("tensorwire sets the ones you leave unset (TENSORWIRE_UCX_DEFAULTS=0: it sets none); see "
                "docs/architecture.md, 'Start-up on a GPU host', for what they trade")


def _report_cuda(report: Report, versions: dict) -> bool:
    """The CUDA devices and the settings that break VRAM transfers; whether there is a device."""
    report.section("CUDA")
    devices, cuda_note = cuda_summary()
    for device in devices:
        report.line(device)
    report.line(cuda_note)
    _check_cuda_match(report, versions, bool(devices))
    if "expandable_segments:true" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower():
        report.loud("WARN", "PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True; NIXL registers such memory "
                    "but UCX then moves it at ~0.3 GB/s", "unset expandable_segments for processes that transfer")
    return bool(devices)


def _report_job(report: Report) -> None:
    """What a job of this environment meets with: its token, where UCX listens, the fleet's directory."""
    report.section("job")
    authenticated, reason = config.job_token_status()
    if authenticated:
        report.line(reason)
    else:
        report.loud("WARN", reason)
    _report_ucx_binding(report)
    _report_fleet(report)


def _report_transports(report: Report, timeout_s: float, quiet: bool, nixl_ok: bool,
                       has_devices: bool) -> ProbeResult | None:
    """The 2-process probes of host and CUDA memory; the CUDA one's result (None when skipped) for the VRAM
    section."""
    report.section("transports (2 processes in a job of their own, UCX_PROTO_INFO=y in their environment)")
    host = run_probe("cpu", timeout_s, quiet) if nixl_ok else None
    _report_probe(report, "host -> host", host, "nixl unavailable")
    cuda = run_probe("cuda", timeout_s + 10, quiet) if nixl_ok and has_devices else None
    _report_probe(report, "cuda -> cuda", cuda, "nixl unavailable" if not nixl_ok else "no CUDA device")
    return cuda


def _report_verdict(report: Report) -> None:
    report.section("verdict")
    if report.problems:
        report.line(f"{len(report.problems)} problem(s):")
        for problem in report.problems:
            report.line(f"- {problem}")
    else:
        report.line("no problems found")


def _report_fleet(report: Report) -> None:
    """With ``TENSORWIRE_DIRECTORY`` set, whether the directory it names answers (a TCP connection to each of
    its addresses, bounded by ``_FLEET_CONNECT_S``); blames the variable or the directory, never the transports."""
    from .environment import parse_directory
    from .errors import InvalidArgumentError

    address = config.load().directory
    if address is None:
        report.line("TENSORWIRE_DIRECTORY is not set: processes join a launcher's world (torchrun, mpirun, SLURM)")
        return
    try:
        parsed = parse_directory(address)
        kind, endpoints = parsed.scheme, parsed.endpoints
    except InvalidArgumentError as e:
        report.loud("FAIL", f"TENSORWIRE_DIRECTORY={address!r} is not a directory address: {e}",
                    "export TENSORWIRE_DIRECTORY=tcp://HOST:PORT (the address 'tensorwire directory' printed)")
        return
    answers = {endpoint: _connects(*endpoint) for endpoint in endpoints}
    if not any(why is None for why in answers.values()):
        what = "no directory" if kind == "tcp" else "no etcd endpoint"
        tried = "; ".join(f"{host}:{port}: {why}" for (host, port), why in answers.items())
        host, port = endpoints[0]
        start = (f"start one there ('tensorwire directory --host {host} --port {port}') or export the address a "
                 "running one printed" if kind == "tcp" else "start etcd there or list endpoints that run")
        report.loud("FAIL", f"fleet: TENSORWIRE_DIRECTORY={address}, and {what} answers there ({tried}); "
                    "every tw.init() of this environment joins that fleet and will fail",
                    f"{start}, or unset TENSORWIRE_DIRECTORY to join a launcher's world")
        return
    up = [f"{host}:{port}" for (host, port), why in answers.items() if why is None]
    if kind == "tcp" and not _admitted(report, address, *endpoints[0]):
        return
    report.line(f"fleet: TENSORWIRE_DIRECTORY={address}: the {'directory' if kind == 'tcp' else 'etcd cluster'} "
                f"answers at {', '.join(up)}; tw.init() here joins that fleet")
    if config.load().name is None:
        report.line("fleet: TENSORWIRE_NAME is not set: give each member init(name=...) or TENSORWIRE_NAME")


def _admitted(report: Report, address: str, host: str, port: int) -> bool:
    """Whether the embedded directory at ``host:port`` admits this environment's job token (its handshake, then
    one round trip); a FAIL saying what to fix where it does not."""
    from .errors import TensorwireError
    from .meeting.directory_store import DirectoryStore

    try:
        DirectoryStore(host, port, token=config.load().job_token, lease_s=2 * _FLEET_CONNECT_S,
                       connect_s=_FLEET_CONNECT_S, request_s=_FLEET_CONNECT_S).close()
    except TensorwireError as e:
        report.loud("FAIL", f"fleet: TENSORWIRE_DIRECTORY={address}: the directory answers but does not admit this "
                    f"environment ({e})", "export the fleet's TENSORWIRE_JOB_TOKEN (the one the directory was "
                    "started with) or point TENSORWIRE_DIRECTORY at this fleet's directory")
        return False
    return True


def _connects(host: str, port: int) -> str | None:
    """None when a TCP connection to ``host:port`` opens within ``_FLEET_CONNECT_S``, else why not."""
    try:
        with socket.create_connection((host, port), timeout=_FLEET_CONNECT_S):
            return None
    except OSError as e:
        return e.strerror or type(e).__name__


def _report_leftovers(report: Report, clean: bool) -> None:
    """The ``/dev/shm`` files of tensorwire processes that were killed (``shared_memory.orphans``)."""
    from .shared_memory import SHM_DIRECTORY, orphans, remove_orphans

    report.section("shared memory")
    found = orphans()
    size = sum(_file_size(path) for path in found)
    if not found:
        report.line(f"no files in {SHM_DIRECTORY} left by tensorwire processes that are gone")
    elif clean:
        removed = remove_orphans()
        report.line(f"removed {len(removed)} file(s) ({size} bytes) left in {SHM_DIRECTORY} by tensorwire processes "
                    "that are gone (killed)")
    else:
        report.loud("WARN", f"{len(found)} file(s) ({size} bytes) in {SHM_DIRECTORY} left by tensorwire processes "
                    "that are gone (killed)", "the next tw.init, tw.shared_empty or tensorwire doctor removes them")


def _file_size(path: str) -> int:
    """Bytes of ``path``, 0 when another process removed it meanwhile."""
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _table(report: Report, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        report.line("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip())


def _check_cuda_match(report: Report, versions: dict, has_devices: bool) -> None:
    """The nixl meta package picks nixl_cuXX at import time; a mismatch with torch's CUDA breaks VRAM."""
    module, torch_cuda = versions["nixl_module"], versions["torch_cuda"]
    if not (has_devices and module and torch_cuda and module.startswith("nixl_cu")):
        return
    if module[len("nixl_cu"):] != torch_cuda.split(".")[0]:
        report.loud("WARN", f"nixl loaded {module} but torch is built for CUDA {torch_cuda}",
                    f"pip install nixl-cu{torch_cuda.split('.')[0]}")


def _report_probe(report: Report, label: str, probe: ProbeResult | None, skipped_because: str) -> None:
    if probe is None:
        report.line(f"{label:<14}skipped: {skipped_because}")
        return
    memory = "host" if probe.memory == "cpu" else "cuda"
    for op in ("WRITE", "READ"):
        rows = [r for r in probe.rows if r.op == op]
        if not rows:
            report.line(f"{label:<14}{op:<6}no ucp_{'put' if op == 'WRITE' else 'get'} table seen")
        for row in rows:
            memories = "->".join(row.memories)
            report.line(f"{label:<14}{op:<6}{row.config:<15} ({row.size_range}, {row.description}; "
                        f"UCX saw {memories} memory)")
        transports = {t for r in rows for t in r.transports}
        if transports and all(t.startswith("tcp/") for t in transports):
            report.loud("WARN", f"{label} {op} only has TCP emulation ({', '.join(sorted(transports))}): "
                        "expect a few GB/s at best", _TCP_ONLY_FIX[memory])
    for rank in sorted(probe.steps):
        checks = [s for s in probe.steps[rank] if s["step"].endswith("bytes")]
        for check in checks:
            report.line(f"{label:<14}rank {rank} {check['step']}: {'ok' if check['ok'] else 'WRONG'}"
                        + ("" if probe.memory == "cpu" or "tensorwire's choice" in check["step"] else " (over nixl)"))
    for message in probe.ucx_messages[:5]:
        report.line(f"{label:<14}UCX said: {message}")
    if probe.memory == "cpu":  # the CUDA probe's failures are the VRAM section's subject
        for failure in probe.failures():
            report.loud("FAIL", f"{label} probe: {failure}", _probe_fix(probe))
        if probe.error and not probe.failures():
            report.loud("FAIL", f"{label} probe: {probe.error}", _probe_fix(probe))


def _probe_fix(probe: ProbeResult) -> str:
    """Where to look when a probe fails: before its ranks met, the meeting (nothing of UCX ran yet); after, UCX's
    own words above, and the UCX settings in force."""
    if not probe.met():
        return ("the probe's two processes failed in tw.init, before any transfer (they meet on 127.0.0.1 in a job "
                "of their own); the error above says why: check that this host lets a process listen on and connect "
                "to 127.0.0.1, and the TENSORWIRE_* variables of this environment")
    settings = sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith("UCX_"))
    where = f"UCX settings in this environment: {', '.join(settings)}" if settings else "no UCX_* variables are set"
    return f"read 'UCX said' above; {where}; unset or widen them (NIXL needs a host transport even for VRAM)"


def _report_vram(report: Report, probe: ProbeResult | None, nixl_ok: bool) -> None:
    """Say LOUDLY whether NIXL moved CUDA memory as CUDA memory, and why not."""
    if probe is None:
        report.line(f"skipped: {'nixl unavailable' if not nixl_ok else 'no CUDA device'}")
        return
    registered = [probe.step(r, "register") for r in (0, 1)]
    if not all(s and s["ok"] for s in registered):
        detail = next((s["detail"] for s in registered if s and not s["ok"]), probe.error or "the probe died first")
        report.loud("FAIL", f"NIXL could not register CUDA memory as VRAM: {detail}",
                    "install the nixl wheel of your CUDA major (nixl-cu12 / nixl-cu13) and make sure UCX's "
                    "CUDA support loads (a UCX built without CUDA cannot register VRAM)")
        return
    report.line("registration of a CUDA tensor as VRAM: ok")
    host_rows = [r for r in probe.rows if "host" in r.memories]
    if host_rows and not any("cuda" in r.memories for r in probe.rows):
        report.loud("FAIL", "UCX treated VRAM as HOST memory (its tables say "
                    f"'{host_rows[0].operation}'): its CUDA memory support did not load",
                    "install the nixl wheel of your CUDA major (nixl-cu12 / nixl-cu13); check that libcuda is "
                    "visible to the process; do not trust GPU transfers until this passes")
    failures = probe.failures()
    if failures or probe.error:
        report.loud("FAIL", "the 2-process VRAM transfer failed: " + "; ".join(failures or [probe.error]),
                    "if bytes are wrong, UCX probably used a host path on device pointers: see the transports "
                    f"above; otherwise {_probe_fix(probe)}")
        return
    report.line("2-process VRAM transfer (READ and WRITE, 1 MiB): bytes verified on both ranks")
