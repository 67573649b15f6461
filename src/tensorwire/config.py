"""Defaults, and the only reader of ``TENSORWIRE_*`` environment variables.

| variable                          | default | meaning                                              |
|-----------------------------------|---------|------------------------------------------------------|
| ``TENSORWIRE_TIMEOUT``            | 300     | seconds any wait may take when no timeout is given   |
| ``TENSORWIRE_PROGRESS_WAKEUP_MS`` | 10      | idle wake-up period of NIXL's event-driven progress  |
| ``TENSORWIRE_SPIN_US``            | 50      | a waiter polls without sleeping this long first      |
| ``TENSORWIRE_MAX_SLEEP_US``       | 1000    | longest sleep between two polls of a waiter          |
| ``TENSORWIRE_LIVENESS_S``         | 5       | seconds within which a dead peer, a lost store or a  |
|                                   |         | cut link ends every blocked call (``PeerLostError``) |
| ``TENSORWIRE_JOB_TOKEN``          | unset   | the job's secret (>= 16 characters, the same on every|
|                                   |         | rank): authenticates every value in the store        |
| ``TENSORWIRE_DIRECTORY``          | unset   | ``tcp://HOST:PORT`` or ``etcd://HOST:PORT[,...]``:   |
|                                   |         | join a fleet there (``init``'s ``directory=``)       |
|                                   |         | instead of a launcher's world                        |
| ``TENSORWIRE_NAME``               | unset   | this member's name in the fleet (``init``'s ``name=``;|
|                                   |         | ``{rank}`` in it: the launcher's rank, e.g. torchrun)|
| ``TENSORWIRE_ETCD_USER``          | unset   | the user of an etcd directory with authentication    |
|                                   |         | enabled (or ``etcd://USER@HOST:PORT``)               |
| ``TENSORWIRE_ETCD_PASSWORD``      | unset   | that user's password (never in the URL)              |
| ``TENSORWIRE_ETCD_PASSWORD_FILE`` | unset   | a file whose first line is the password instead      |
| ``TENSORWIRE_ETCD_CA``            | unset   | PEM CA that signed etcd's server certificate;        |
|                                   |         | set: TLS to etcd (``etcds://``: TLS with the         |
|                                   |         | system's CAs)                                        |
| ``TENSORWIRE_ETCD_CERT``          | unset   | PEM client certificate for etcd's                    |
|                                   |         | ``--client-cert-auth`` (mutual TLS)                  |
| ``TENSORWIRE_ETCD_KEY``           | unset   | its PEM private key (unset: in the certificate file) |
| ``TENSORWIRE_VLLM_PYTHON``        | unset   | ``tensorwire bench vllm``: the interpreter with vLLM |
|                                   |         | (unset: ``.venv-vllm/bin/python`` of the checkout)   |
| ``TENSORWIRE_UCX_DEFAULTS``       | 1       | 0: leave UCX's start-up options to UCX (see          |
|                                   |         | ``backends/nixl_setup.py``, ``UCX_START_DEFAULTS``)  |

The library writes ``os.environ`` in one place only: ``backends/nixl_setup.py`` sets UCX's start-up options the user
has not set, once, before NIXL first loads (UCX reads them from nowhere else).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from .errors import InvalidArgumentError


def _read(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise InvalidArgumentError(
            f"config: {name}={raw!r} is not a number; unset it or give seconds/units as a number"
        ) from None
    if not math.isfinite(value):
        raise InvalidArgumentError(f"config: {name}={raw!r} is not finite; unset it or give a number")
    if value < 0:
        raise InvalidArgumentError(f"config: {name}={raw!r} is negative; give a value >= 0")
    return value


_TOKEN_VARIABLE = "TENSORWIRE_JOB_TOKEN"
_MIN_TOKEN_CHARS = 16
_MAKE_TOKEN = "export TENSORWIRE_JOB_TOKEN=$(python -c 'import secrets;print(secrets.token_hex(16))')"


def _read_token() -> bytes | None:
    raw = os.environ.get(_TOKEN_VARIABLE)
    if raw is None or raw == "":
        return None
    if len(raw) < _MIN_TOKEN_CHARS:
        raise InvalidArgumentError(
            f"config: {_TOKEN_VARIABLE} has {len(raw)} characters, fewer than {_MIN_TOKEN_CHARS}: too easy to guess; "
            f"set a random one on every rank before launching: {_MAKE_TOKEN}"
        )
    return raw.encode()


_PASSWORD_VARIABLE = "TENSORWIRE_ETCD_PASSWORD"


def _read_etcd_password() -> str | None:
    """The etcd password from the environment or from the file it names (its first line); never from a URL."""
    raw, path = os.environ.get(_PASSWORD_VARIABLE) or None, os.environ.get(_PASSWORD_VARIABLE + "_FILE") or None
    if raw is not None and path is not None:
        raise InvalidArgumentError(f"config: both {_PASSWORD_VARIABLE} and {_PASSWORD_VARIABLE}_FILE={path!r} are "
                                   "set; unset one")
    if path is None:
        return raw
    try:
        with open(path, encoding="utf-8") as f:
            password = f.readline().rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidArgumentError(f"config: {_PASSWORD_VARIABLE}_FILE={path!r} cannot be read "
                                   f"({type(e).__name__}: {e.strerror if isinstance(e, OSError) else e.reason}); "
                                   "give a readable file whose first line is the etcd password") from None
    if not password:
        raise InvalidArgumentError(f"config: {_PASSWORD_VARIABLE}_FILE={path!r} holds no password on its first line")
    return password


def _liveness() -> float:
    value = _read("TENSORWIRE_LIVENESS_S", 5.0)
    if value < 1.0:
        raise InvalidArgumentError(
            f"config: TENSORWIRE_LIVENESS_S={value:g} is below 1 second: TCP keepalive counts in whole seconds and a "
            "busy host would be declared dead; give a value >= 1")
    return value


@dataclass(frozen=True)
class Config:
    timeout_s: float
    progress_wakeup_ms: float
    spin_us: float
    max_sleep_us: float
    liveness_s: float = 5.0
    # The job's secret; never shown in a repr (configs end up in logs).
    job_token: bytes | None = field(default=None, repr=False)
    directory: str | None = None  # a fleet's directory address (TENSORWIRE_DIRECTORY)
    name: str | None = None  # this member's name in it (TENSORWIRE_NAME)
    etcd_user: str | None = None  # TENSORWIRE_ETCD_USER
    etcd_password: str | None = field(default=None, repr=False)  # TENSORWIRE_ETCD_PASSWORD(_FILE); never shown
    etcd_ca: str | None = None  # TENSORWIRE_ETCD_CA: a path
    etcd_cert: str | None = None  # TENSORWIRE_ETCD_CERT: a path
    etcd_key: str | None = None  # TENSORWIRE_ETCD_KEY: a path


def load() -> Config:
    """Read the environment once; call it at ``tw.init`` time."""
    return Config(
        timeout_s=_read("TENSORWIRE_TIMEOUT", 300.0),
        progress_wakeup_ms=_read("TENSORWIRE_PROGRESS_WAKEUP_MS", 10.0),
        spin_us=_read("TENSORWIRE_SPIN_US", 50.0),
        max_sleep_us=_read("TENSORWIRE_MAX_SLEEP_US", 1000.0),
        liveness_s=_liveness(),
        job_token=_read_token(),
        directory=os.environ.get("TENSORWIRE_DIRECTORY") or None,
        name=os.environ.get("TENSORWIRE_NAME") or None,
        etcd_user=os.environ.get("TENSORWIRE_ETCD_USER") or None,
        etcd_password=_read_etcd_password(),
        etcd_ca=os.environ.get("TENSORWIRE_ETCD_CA") or None,
        etcd_cert=os.environ.get("TENSORWIRE_ETCD_CERT") or None,
        etcd_key=os.environ.get("TENSORWIRE_ETCD_KEY") or None,
    )


def ucx_defaults_enabled() -> bool:
    """Whether tensorwire may set UCX's start-up options the user left unset (``TENSORWIRE_UCX_DEFAULTS``, default 1;
    0, ``no``, ``false`` or ``off`` turn it off)."""
    raw = os.environ.get("TENSORWIRE_UCX_DEFAULTS", "").strip().lower()
    return raw not in ("0", "no", "false", "off", "n")


def vllm_python() -> str | None:
    """The interpreter with vLLM that ``TENSORWIRE_VLLM_PYTHON`` names (``tensorwire bench vllm``), None if unset."""
    return os.environ.get("TENSORWIRE_VLLM_PYTHON") or None


def job_token_status() -> tuple[bool, str]:
    """``(authenticated, reason)`` for this process's environment, for diagnostics; never raises.

    ``authenticated`` is True when ``TENSORWIRE_JOB_TOKEN`` holds a usable token, i.e. every value this
    process puts in the job's store is encrypted and authenticated, and every value it reads must open."""
    try:
        token = _read_token()
    except InvalidArgumentError as e:
        return False, str(e)
    if token is None:
        return False, (
            f"{_TOKEN_VARIABLE} is not set: the job is unauthenticated, so any process that reaches the store port "
            "can read the memory maps (addresses, NIXL metadata, shm names), READ and WRITE registered memory with "
            f"them, and forge maps, descriptors and barrier entries; set the same token on every rank: {_MAKE_TOKEN}"
        )
    return True, (f"{_TOKEN_VARIABLE} is set: values in the store are encrypted and authenticated (AES-256-GCM, "
                  "bound to their key), NIXL agents have unguessable names and only members' notifications count")
