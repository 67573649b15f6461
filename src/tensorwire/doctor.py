"""``tensorwire doctor``: what works on this machine, what does not, why, and what to do.

It reports, in order: software versions (UCX's too, read from the library NIXL bundles); the backends
table; the CUDA devices; whether NIXL really moves CUDA memory as VRAM (registration, then a 2-process
transfer whose bytes are checked: some UCX builds silently treat VRAM as host memory); and which UCX
transport a host-to-host and a GPU-to-GPU transfer really take here. For the last, the probe processes get
``UCX_PROTO_INFO=y`` and ``UCX_LOG_FILE`` in *their* environment (through ``launch(env=...)``; nothing writes
this process's ``os.environ``) and the protocol tables UCX writes are parsed for the ``ucp_put*`` /
``ucp_get*`` rows.

Every probe is bounded in time, and a failing probe is reported, never raised: the doctor exits 0 whenever
it could diagnose. Non-goals: fixing anything, benchmarking (``tensorwire bench`` does that). The machine
facts it prints come from ``tensorwire.machine``.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

# cpu_model and ucx_version are only re-exported: they lived here before machine.py.
from .config import job_token_status
from .machine import cpu_model, cuda_summary, software_versions, ucx_version
from .ucx_protocols import ProtoRow, parse_proto_info, transfer_rows, warnings_and_errors

__all__ = [
    "ProtoRow", "parse_proto_info", "ProbeResult", "run_probe", "software_versions", "cpu_model",
    "cuda_summary", "ucx_version", "diagnose",
]

_PROBE_BYTES = 1 << 20
_TCP_ONLY_FIX = {
    "host": "UCX found no shared-memory path between the two processes. cma needs ptrace permission between "
            "them (/proc/sys/kernel/yama/ptrace_scope 0 or 1 with the same user; in a container add "
            "--cap-add SYS_PTRACE); also check that UCX_TLS, if set, keeps cma or sm",
    "cuda": "UCX found no cuda_ipc path between the two processes. Give both the same GPUs and IPC namespace "
            "(docker --ipc=host, same CUDA_VISIBLE_DEVICES), keep cuda_ipc in UCX_TLS if set, and install the "
            "nixl wheel of your CUDA major (nixl-cu12 or nixl-cu13)",
}


# --- the 2-process probe ----------------------------------------------------------------------------
def _flush_c_stdio() -> None:
    """UCX writes its log with C stdio; ``launch`` ends ranks with ``os._exit``, which would drop the buffer."""
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass


def _move(comm, op, local, remote, transport: str | None) -> str:
    """One blocking transfer over ``transport`` (None: tensorwire's choice); returns the transport used."""
    with comm.prepare(op, local, remote, transport=transport) as transfer:
        transfer.post()
        transfer.wait()
        return transfer.transport


class _StepLog:
    """One rank's log of the probe's steps (``steps.<rank>.jsonl`` in ``workdir``), appended at once so that a
    crash still leaves what came before; ``current`` is the step in progress, under which a failure is logged."""

    def __init__(self, workdir: str, rank: int) -> None:
        self.path, self.current = os.path.join(workdir, f"steps.{rank}.jsonl"), "init"

    def record(self, ok: bool, detail: str, step: str | None = None) -> None:
        with open(self.path, "a") as log:
            log.write(json.dumps({"step": step or self.current, "ok": ok, "detail": detail}) + "\n")

    def check_bytes(self, step: str, got, expected, sender: int) -> None:
        from .testing.data import first_mismatch

        index = first_mismatch(got, expected)
        if index is None:
            self.record(True, f"all {got.numel()} bytes from rank {sender} are right", step)
        else:
            self.record(False, f"byte {index} of {got.numel()} differs (got {int(got[index])}, rank {sender} holds "
                        f"{int(expected[index])}): the transfer reported success but moved the wrong bytes", step)


def _probe_rank(memory: str, workdir: str, quiet: bool, timeout_s: float) -> None:
    """One rank of the transfer probe (run by ``launch``). Over NIXL (forced: the probe is about what NIXL
    and UCX do), rank 0 READs rank 1's outbox into its inbox and WRITEs its outbox into rank 1's inbox; each
    receiver checks the bytes. For CUDA memory rank 0 then READs once more over tensorwire's own choice of
    transport (``cuda_ipc`` on one host) and checks again. Steps go to ``workdir``."""
    import tensorwire as tw

    from .backends.nixl import quiet_nixl_logging
    from .testing.data import rank_pattern

    if quiet:
        quiet_nixl_logging()
    steps = _StepLog(workdir, int(os.environ.get("RANK", "0")))
    try:
        comm = tw.init(timeout=timeout_s)
        steps.record(True, f"{comm!r}")
        registration, buffer, remote = _probe_buffer(comm, memory, steps)
        if comm.rank == 0:
            _probe_transfers(comm, memory, buffer, remote, steps)
        steps.current = "barrier"
        comm.barrier()
        if comm.rank == 1:
            n, peer = _PROBE_BYTES, 1 - comm.rank
            steps.check_bytes("WRITE bytes", buffer[n:], rank_pattern(n, peer, buffer.device), peer)
        comm.barrier()
        steps.current = "close"
        registration.close()
        comm.close()
    except BaseException as e:  # recorded for the report, then re-raised so launch stops all ranks
        steps.record(False, f"{type(e).__name__}: {e}")
        raise
    finally:
        _flush_c_stdio()


def _probe_buffer(comm, memory: str, steps: _StepLog):
    """Register ``[outbox | inbox]`` (the outbox holds this rank's pattern), publish it and look up the peer's;
    returns (registration, buffer, the peer's descriptor). Blocks until the peer has published."""
    import torch

    from .testing.data import rank_pattern

    device = comm.device if memory == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    n = _PROBE_BYTES
    buffer = torch.zeros(2 * n, dtype=torch.uint8, device=device)  # [outbox | inbox]
    buffer[:n].copy_(rank_pattern(n, comm.rank, device))
    steps.current = "register"
    registration = comm.register(buffer)
    steps.record(True, f"{2 * n} bytes on {device} as {'VRAM' if memory == 'cuda' else 'DRAM'}")
    comm.publish("doctor", registration.descs)
    remote = comm.lookup("doctor", 1 - comm.rank)[0]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return registration, buffer, remote


def _probe_transfers(comm, memory: str, buffer, remote, steps: _StepLog) -> None:
    """Rank 0's transfers: READ the peer's outbox and WRITE this outbox into the peer's inbox over NIXL, and for
    CUDA memory READ again over tensorwire's choice of transport; checks the bytes READ. Blocking."""
    import torch

    import tensorwire as tw

    from .testing.data import rank_pattern

    n, peer, device = _PROBE_BYTES, 1 - comm.rank, buffer.device
    steps.current = "READ"
    _move(comm, tw.READ, buffer[n:], remote.narrow(0, n), "nixl")
    steps.record(True, f"{n} bytes from rank {peer} over nixl")
    steps.check_bytes("READ bytes", buffer[n:], rank_pattern(n, peer, device), peer)
    steps.current = "WRITE"
    _move(comm, tw.WRITE, buffer[:n], remote.narrow(n, n), "nixl")
    steps.record(True, f"{n} bytes to rank {peer} over nixl")
    if memory == "cuda":
        steps.current = "default READ"
        buffer[n:].zero_()
        torch.cuda.synchronize(device)
        chosen = _move(comm, tw.READ, buffer[n:], remote.narrow(0, n), None)
        torch.cuda.synchronize(device)  # a stream-ordered transport's copy is on the current stream
        steps.record(True, chosen)
        steps.check_bytes(f"READ over {chosen} (tensorwire's choice) bytes", buffer[n:],
                          rank_pattern(n, peer, device), peer)


@dataclass
class ProbeResult:
    memory: str
    steps: dict[int, list[dict]] = field(default_factory=dict)
    error: str | None = None  # why launch failed (a rank raised, crashed or timed out)
    rows: list[ProtoRow] = field(default_factory=list)
    ucx_messages: list[str] = field(default_factory=list)

    def step(self, rank: int, name: str) -> dict | None:
        return next((s for s in self.steps.get(rank, []) if s["step"] == name), None)

    def failures(self) -> list[str]:
        return [f"rank {r} {s['step']}: {s['detail']}" for r in sorted(self.steps) for s in self.steps[r]
                if not s["ok"]]


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


def run_probe(memory: str, timeout_s: float = 15.0, quiet: bool = True) -> ProbeResult:
    """Move 1 MiB both ways between two fresh processes over ``memory`` ("cpu" or "cuda") with UCX's
    protocol tables on; never raises for a failing probe (the failure is in the result)."""
    from .errors import TensorwireError
    from .testing import launch

    result = ProbeResult(memory)
    with tempfile.TemporaryDirectory(prefix="tensorwire-doctor-") as workdir:
        env = {"UCX_PROTO_INFO": "y", "UCX_LOG_FILE": os.path.join(workdir, "ucx.%p.log")}
        try:
            launch(_probe_rank, 2, memory, workdir, quiet, timeout_s, timeout=timeout_s + 5, env=env)
        except TensorwireError as e:
            lines = str(e).strip().splitlines()
            result.error = lines[0] + (f" ... {lines[-1]}" if len(lines) > 1 else "")
        for rank in (0, 1):
            path = Path(workdir, f"steps.{rank}.jsonl")
            if path.exists():
                result.steps[rank] = [json.loads(line) for line in path.read_text().splitlines() if line]
        for path in sorted(Path(workdir).glob("ucx.*.log")):
            text = path.read_text(errors="replace")
            result.rows += parse_proto_info(text)
            result.ucx_messages += warnings_and_errors(text)
    result.rows = transfer_rows(result.rows)
    return result


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
             clean: bool = False) -> Report:
    """Run every check, printing through ``emit`` as it goes; returns the report (problems listed). ``clean``:
    remove the ``/dev/shm`` files that tensorwire processes gone since left (else only count them)."""
    from . import backends
    from .backends.nixl_setup import INSTALL_NIXL, nixl_installed

    report = Report(emit)
    emit("tensorwire doctor")
    versions = software_versions()
    report.section("versions")
    for name in ("tensorwire", "torch", "nixl", "ucx", "python"):
        value = versions[name] or "not found"
        if name == "torch":
            value += f" (CUDA {versions['torch_cuda']})" if versions["torch_cuda"] else " (CPU-only build)"
        if name == "nixl" and versions["nixl_module"]:
            value += f" (loaded {versions['nixl_module']})"
        report.line(f"{name:<11}{value}")

    infos = backends()
    report.section("backends")
    _table(report, ["backend", "available", "version", "reason", "fix"],
           [[i.name, "yes" if i.available else "no", i.version or "-", i.reason, i.fix or "-"] for i in infos.values()])
    if not nixl_installed():  # an extra: a job of one host runs without it
        report.loud("WARN", "nixl is not installed: ranks reach each other on this host only, over shm (host "
                    "memory from tw.shared_empty) and cuda_ipc", INSTALL_NIXL)
    elif not infos["nixl"].available:
        report.loud("FAIL", f"backend nixl is unavailable: {infos['nixl'].reason}", infos["nixl"].fix)
    nixl_ok = infos["nixl"].available

    report.section("CUDA")
    devices, cuda_note = cuda_summary()
    for device in devices:
        report.line(device)
    report.line(cuda_note)
    _check_cuda_match(report, versions, bool(devices))
    if "expandable_segments:true" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower():
        report.loud("WARN", "PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True; NIXL registers such memory "
                    "but UCX then moves it at ~0.3 GB/s", "unset expandable_segments for processes that transfer")

    report.section("job")
    authenticated, reason = job_token_status()
    if authenticated:
        report.line(reason)
    else:
        report.loud("WARN", reason)
    _report_ucx_binding(report)
    _report_leftovers(report, clean)  # before the probes: their tw.init would remove the files unreported

    report.section("transports (2 processes, UCX_PROTO_INFO=y in their environment)")
    host = run_probe("cpu", timeout_s, quiet) if nixl_ok else None
    _report_probe(report, "host -> host", host, "nixl unavailable")
    cuda = run_probe("cuda", timeout_s + 10, quiet) if nixl_ok and devices else None
    _report_probe(report, "cuda -> cuda", cuda, "nixl unavailable" if not nixl_ok else "no CUDA device")

    report.section("NIXL VRAM")
    _report_vram(report, cuda, nixl_ok)

    report.section("verdict")
    if report.problems:
        report.line(f"{len(report.problems)} problem(s):")
        for problem in report.problems:
            report.line(f"- {problem}")
    else:
        report.line("no problems found")
    return report


def _report_leftovers(report: Report, clean: bool) -> None:
    """The ``/dev/shm`` files of tensorwire processes that were killed (``shared_memory.orphans``)."""
    from .shared_memory import SHM_DIRECTORY, orphans, remove_orphans

    report.section("shared memory")
    found = remove_orphans() if clean else orphans()
    if not found:
        report.line(f"no files in {SHM_DIRECTORY} left by tensorwire processes that are gone")
    elif clean:
        report.line(f"removed {len(found)} file(s) left in {SHM_DIRECTORY} by tensorwire processes that are gone")
    else:
        size = sum(_file_size(path) for path in found)
        report.loud("WARN", f"{len(found)} file(s) ({size} bytes) in {SHM_DIRECTORY} left by tensorwire processes "
                    "that are gone (killed)", "tensorwire doctor --clean removes them (so does the next tw.init)")


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
            report.loud("FAIL", f"{label} probe: {failure}", _probe_fix())
        if probe.error and not probe.failures():
            report.loud("FAIL", f"{label} probe: {probe.error}", _probe_fix())


def _probe_fix() -> str:
    """Where to look when a probe fails: UCX's own words above, and the UCX settings in force."""
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
                    f"above; otherwise {_probe_fix()}")
        return
    report.line("2-process VRAM transfer (READ and WRITE, 1 MiB): bytes verified on both ranks")
