"""The doctor's 2-process probe: two fresh processes (``testing.launch``) meet in a job of their own on this host,
register 1 MiB of ``memory`` ("cpu" or "cuda") each, and move it both ways over NIXL with UCX's protocol tables on
(``UCX_PROTO_INFO=y`` and ``UCX_LOG_FILE`` in *their* environment, through ``launch(env=...)``; nothing writes this
process's ``os.environ``); each receiver checks the bytes. Each rank logs its steps to a file as it goes, so a rank
that dies still leaves what came before; ``run_probe`` reads them back with UCX's tables into a ``ProbeResult``.

The probe's ranks always meet as a launcher's world of 2 (explicit rank and world size): a fleet's
``TENSORWIRE_DIRECTORY`` in the environment is the doctor's fleet section's subject, not theirs. Every probe is
bounded in time and never raises for a failure (the failure is in the result). Non-goals: the report
(``tensorwire.doctor``).
"""

from __future__ import annotations

import ctypes
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .ucx_protocols import ProtoRow, parse_proto_info, transfer_rows, warnings_and_errors

__all__ = ["ProbeResult", "run_probe", "INIT_STEP"]

_PROBE_BYTES = 1 << 20
INIT_STEP = "init"  # the step of a rank that has not met its peer yet: nothing of NIXL or UCX ran


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
        self.path, self.current = os.path.join(workdir, f"steps.{rank}.jsonl"), INIT_STEP

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
    rank = int(os.environ.get("RANK", "0"))  # launch's
    steps = _StepLog(workdir, rank)
    try:
        # rank and world size given: a launcher's world of 2, whatever fleet TENSORWIRE_DIRECTORY names
        comm = tw.init(rank=rank, world_size=2, timeout=timeout_s)
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

    def met(self) -> bool:
        """Whether the ranks got past meeting each other (a failure before that is not NIXL's or UCX's)."""
        return all(any(s["step"] == INIT_STEP and s["ok"] for s in self.steps.get(r, [])) for r in (0, 1))

    def failures(self) -> list[str]:
        return [f"rank {r} {s['step']}: {s['detail']}" for r in sorted(self.steps) for s in self.steps[r]
                if not s["ok"]]



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


