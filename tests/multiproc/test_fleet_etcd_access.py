"""Fleets in an etcd that checks who asks: one etcd node on loopback (started by the test, killed when it ends)
with authentication enabled (a user whose role may read and write ``tensorwire/`` only), or serving TLS with
client-certificate authentication (a CA, a server certificate for 127.0.0.1 and a client certificate, made by the
test with ``cryptography``). Two members launched apart meet with the credentials in their environment and one
reads the other's blocks; a member with a wrong password, without credentials, without the client certificate or
trusting another CA fails at ``init`` with a typed error saying what to check (and never showing the password).

Skipped, with the reason, where no ``etcd`` binary (Debian: ``etcd-server``), no ``etcd3gw`` or no ``cryptography``
is installed.
"""

from __future__ import annotations

import base64
import datetime
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

import tensorwire as tw
from tensorwire.meeting.etcd_access import EtcdAccess
from tensorwire.testing import free_port

if shutil.which("etcd") is None:
    pytest.skip("no etcd binary (apt-get install etcd-server): etcd credentials not tested", allow_module_level=True)
pytest.importorskip("etcd3gw", reason="no etcd client (pip install etcd3gw): etcd credentials not tested")
pytest.importorskip("cryptography", reason="no cryptography (pip install cryptography): no certificates to test with")
requests = pytest.importorskip("requests", reason="no requests (etcd3gw's dependency): etcd credentials not tested")

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(os.path.dirname(HERE)), "src")
TOKEN = "etcd-access-token-0123456789"
USER, PASSWORD = "tensorwire-fleet", "correct horse battery staple"
LIVENESS_S = 2.0
BLOCKS, WIDTH = 64, 16
WAIT = 30.0


def _value(member: int) -> torch.Tensor:
    """Member ``member``'s blocks: element (b, e) = member * 1_000_000 + b * WIDTH + e."""
    return torch.arange(BLOCKS * WIDTH, dtype=torch.int32).view(BLOCKS, WIDTH) + member * 1_000_000


def _await(path: str, process: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if process.poll() is not None:
            raise RuntimeError(f"the member exited ({process.returncode}) before {path} appeared")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout}s")
        time.sleep(0.01)


# --- the members (run as `python -c "import test_fleet_etcd_access; test_fleet_etcd_access._<member>(...)"`) ----
def _holder(directory: str, work: str) -> None:
    """Publishes its blocks as ``kv`` under the name ``holder-1`` and stays until ``stop`` appears."""
    comm = tw.init(directory=directory, name="holder-1", timeout=WAIT)
    pool = comm.register_blocks(_value(1).clone())
    comm.publish_blocks("kv", pool)
    with open(os.path.join(work, "holder.ready"), "w") as f:
        f.write(str(comm.rank))
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(work, "stop")) and time.monotonic() < deadline:
        time.sleep(0.02)
    pool.close()
    comm.close()


def _reader(directory: str, work: str) -> None:
    """Finds ``holder-1`` by name, reads every block of it, and writes what it saw to ``reader.json``."""
    comm = tw.init(directory=directory, name="reader-0", timeout=WAIT)
    out = torch.zeros(BLOCKS, WIDTH, dtype=torch.int32)
    pool = comm.register_blocks(out)
    rank = comm.rank_of("holder-1", timeout=WAIT)
    transfer = comm.prepare_blocks(tw.READ, pool, comm.lookup_blocks("kv", rank, timeout=WAIT))
    ids = list(range(BLOCKS))
    transfer.post(ids, ids)
    transfer.wait(timeout=WAIT)
    seen = {"read": bool(torch.equal(out, _value(1))), "members": sorted(m.name for m in comm.members().values())}
    with open(os.path.join(work, "reader.json"), "w") as f:
        json.dump(seen, f)
    transfer.close()
    pool.close()
    comm.close()


def _member_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORWIRE_")}
    env.update({"PYTHONPATH": os.pathsep.join([SRC, HERE, env.get("PYTHONPATH", "")]),
                "TENSORWIRE_LIVENESS_S": str(LIVENESS_S), "TENSORWIRE_JOB_TOKEN": TOKEN, **extra})
    return env


def _meet(directory: str, work: str, extra: dict[str, str]) -> dict:
    """Runs a holder and a reader with ``extra`` in their environment; what the reader saw."""
    processes = []
    try:
        for member in ("_holder", "_reader"):
            code = f"import test_fleet_etcd_access as t; t.{member}({directory!r}, {work!r})"
            processes.append(subprocess.Popen([sys.executable, "-c", code], env=_member_env(extra)))
            if member == "_holder":
                _await(os.path.join(work, "holder.ready"), processes[0])
        assert processes[1].wait(timeout=120) == 0, "the reader failed (its traceback is above)"
        with open(os.path.join(work, "stop"), "w"):
            pass
        assert processes[0].wait(timeout=60) == 0, "the holder failed (its traceback is above)"
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=30)
    with open(os.path.join(work, "reader.json")) as f:
        return json.load(f)


def _init_fails(monkeypatch, directory: str, variables: dict[str, str]) -> tw.TensorwireError:
    """``tw.init`` in this process with only ``variables`` (and the job token) among the TENSORWIRE_ ones: the
    error it raised, which it must raise within a few seconds."""
    for name in [name for name in os.environ if name.startswith("TENSORWIRE_")]:
        monkeypatch.delenv(name)
    for name, value in {"TENSORWIRE_JOB_TOKEN": TOKEN, "TENSORWIRE_LIVENESS_S": str(LIVENESS_S), **variables}.items():
        monkeypatch.setenv(name, value)
    began = time.monotonic()
    with pytest.raises(tw.TensorwireError) as failed:
        tw.init(directory=directory, name="intruder-0", timeout=WAIT)
    took = time.monotonic() - began
    assert took < 2 * LIVENESS_S, f"init took {took:.1f}s to fail: {failed.value}"
    assert PASSWORD not in str(failed.value)
    return failed.value


# --- etcd --------------------------------------------------------------------------------------------------------
class _Etcd:
    """One etcd node on loopback, its own process and data directory; killed when the test ends."""

    def __init__(self, root: str, tls: dict[str, str] | None = None, extra: tuple[str, ...] = ()) -> None:
        self.port, peer = free_port(), free_port()
        scheme = "https" if tls else "http"
        client = f"{scheme}://127.0.0.1:{self.port}"
        flags = [f"--{name}={path}" for name, path in (tls or {}).items()]
        self.log = os.path.join(root, "etcd.log")
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(
                ["etcd", "--name", "n0", "--data-dir", os.path.join(root, "etcd"), "--listen-client-urls", client,
                 "--advertise-client-urls", client, "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                 "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}", "--initial-cluster",
                 f"n0=http://127.0.0.1:{peer}", "--unsafe-no-fsync", *flags, *extra],
                stdout=log, stderr=subprocess.STDOUT)
        self.url = client + "/v3"

    def post(self, path: str, body: dict, tls: dict | None = None, token: str | None = None) -> dict:
        """One request to etcd's gateway; ``tls``: ``verify=`` and ``cert=`` of ``requests``."""
        answer = requests.post(self.url + path, json=body, timeout=5, headers={"Authorization": token} if token else {},
                               **(tls or {}))
        if answer.status_code != 200:
            raise RuntimeError(f"etcd {path}: HTTP {answer.status_code} {answer.text}")
        return answer.json()

    def await_ready(self, tls: dict | None = None, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.post("/kv/range", {"key": _b64("probe")}, tls)
                return
            except (requests.exceptions.ConnectionError, RuntimeError):
                if self.process.poll() is not None or time.monotonic() > deadline:
                    with open(self.log) as f:
                        raise RuntimeError(f"etcd did not start: {f.read()[-2000:]}") from None
                time.sleep(0.05)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)


def _started_etcd(root: str, ready_tls: dict | None = None, **options) -> _Etcd:
    """An etcd node that answers, started again on other ports (up to three times) where one of those it was given
    was taken before it bound it (free_port only proposes a port: a fresh-clone run lost one to another process)."""
    for attempt in range(3):
        folder = os.path.join(root, f"etcd-{attempt}")
        os.makedirs(folder, exist_ok=True)
        etcd = _Etcd(folder, **options)
        try:
            etcd.await_ready(ready_tls)
            return etcd
        except RuntimeError as e:
            etcd.close()
            if "address already in use" not in str(e) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _enable_auth(etcd: _Etcd) -> None:
    """root (etcd needs it to enable authentication) and USER, whose one role reads and writes ``tensorwire/``."""
    etcd.post("/auth/user/add", {"name": "root", "password": "root-" + PASSWORD})
    etcd.post("/auth/user/grant", {"user": "root", "role": "root"})
    etcd.post("/auth/user/add", {"name": USER, "password": PASSWORD})
    etcd.post("/auth/role/add", {"name": "fleet"})
    etcd.post("/auth/role/grant", {"name": "fleet", "perm": {"permType": "READWRITE", "key": _b64("tensorwire/"),
                                                              "range_end": _b64("tensorwire0")}})
    etcd.post("/auth/user/grant", {"user": USER, "role": "fleet"})
    etcd.post("/auth/enable", {})


@pytest.fixture
def auth_etcd(tmp_path):
    # Tokens live 2 s unused: a store idle longer than that must authenticate again.
    etcd = _started_etcd(str(tmp_path), extra=("--auth-token-ttl", "2"))
    try:
        _enable_auth(etcd)
        yield etcd
    finally:
        etcd.close()


def test_members_meet_in_an_etcd_with_authentication(auth_etcd, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    seen = _meet(f"etcd://{USER}@127.0.0.1:{auth_etcd.port}", str(work), {"TENSORWIRE_ETCD_PASSWORD": PASSWORD})
    assert seen == {"read": True, "members": ["holder-1", "reader-0"]}, seen


def test_wrong_or_missing_credentials_fail_init_typed(auth_etcd, tmp_path, monkeypatch):
    directory = f"etcd://127.0.0.1:{auth_etcd.port}"
    wrong = _init_fails(monkeypatch, directory, {"TENSORWIRE_ETCD_USER": USER,
                                                 "TENSORWIRE_ETCD_PASSWORD": PASSWORD + "!"})
    assert isinstance(wrong, tw.AuthenticationError) and repr(USER) in str(wrong), wrong
    assert "TENSORWIRE_ETCD_PASSWORD" in str(wrong), wrong
    password_file = tmp_path / "password"
    password_file.write_text("not-it\n")
    from_file = _init_fails(monkeypatch, f"etcd://{USER}@127.0.0.1:{auth_etcd.port}",
                            {"TENSORWIRE_ETCD_PASSWORD_FILE": str(password_file)})
    assert isinstance(from_file, tw.AuthenticationError), from_file
    none = _init_fails(monkeypatch, directory, {})
    assert isinstance(none, tw.AuthenticationError) and "no credentials" in str(none), none
    assert "TENSORWIRE_ETCD_USER" in str(none), none


def test_a_store_idle_past_the_token_ttl_authenticates_again(auth_etcd):
    from tensorwire.meeting.etcd_store import EtcdStore

    store = EtcdStore([("127.0.0.1", auth_etcd.port)], lease_ttl_s=10, request_s=3,
                      access=EtcdAccess(user=USER, password=PASSWORD))
    store.set("idle", b"1")
    first = store._token
    time.sleep(3.5)  # past --auth-token-ttl: etcd forgot the token
    assert store.get("idle") == b"1"
    assert store._token != first, "the token did not expire: the test proves nothing"
    store.revoke()


def test_a_write_after_the_lease_was_lost_takes_a_new_lease(auth_etcd):
    """etcd answers a write under a lease it no longer has with NOT_FOUND: the store takes a new lease, once."""
    from tensorwire.meeting.etcd_store import EtcdStore

    store = EtcdStore([("127.0.0.1", auth_etcd.port)], lease_ttl_s=10, request_s=3,
                      access=EtcdAccess(user=USER, password=PASSWORD))
    store.set("first", b"1")
    lost = store._lease
    auth_etcd.post("/kv/lease/revoke", {"ID": lost}, token=store._token)  # as if it had expired
    store.set("second", b"2")
    assert store._lease not in (None, lost) and store.get("second") == b"2"
    assert not store.keep_alive(), "keep_alive must say the keys under the lost lease are gone"
    store.revoke()


# --- TLS ---------------------------------------------------------------------------------------------------------
def _certificates(root: str) -> dict[str, str]:
    """PEM files: a CA, etcd's certificate for 127.0.0.1 and a client's, both signed by it; another CA."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    paths: dict[str, str] = {}

    def write(name: str, certificate, key) -> None:
        paths[name] = os.path.join(root, f"{name}.pem")
        with open(paths[name], "wb") as f:
            f.write(certificate.public_bytes(serialization.Encoding.PEM))
        paths[name + "-key"] = os.path.join(root, f"{name}-key.pem")
        with open(paths[name + "-key"], "wb") as f:
            f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()))

    def make(name: str, issuer=None, issuer_key=None, ca: bool = False, san=None, usage=None):
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        builder = (x509.CertificateBuilder().subject_name(subject)
                   .issuer_name(issuer.subject if issuer is not None else subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if san is not None:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        if usage is not None:
            builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
        certificate = builder.sign(issuer_key if issuer_key is not None else key, hashes.SHA256())
        write(name, certificate, key)
        return certificate, key

    ca, ca_key = make("ca", ca=True)
    make("server", ca, ca_key, san=[x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
         usage=[ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH])
    make("client", ca, ca_key, usage=[ExtendedKeyUsageOID.CLIENT_AUTH])
    make("other-ca", ca=True)
    return paths


@pytest.fixture
def tls_etcd(tmp_path):
    certificates = _certificates(str(tmp_path))
    etcd = _started_etcd(str(tmp_path), {"verify": certificates["ca"], "cert": (certificates["client"],
                                                                               certificates["client-key"])},
                         tls={"cert-file": certificates["server"], "key-file": certificates["server-key"],
                              "trusted-ca-file": certificates["ca"], "client-cert-auth": "true"})
    try:
        yield etcd, certificates
    finally:
        etcd.close()


def test_members_meet_in_an_etcd_serving_mutual_tls(tls_etcd, tmp_path):
    etcd, certificates = tls_etcd
    work = tmp_path / "work"
    work.mkdir()
    seen = _meet(f"etcds://127.0.0.1:{etcd.port}", str(work), {
        "TENSORWIRE_ETCD_CA": certificates["ca"], "TENSORWIRE_ETCD_CERT": certificates["client"],
        "TENSORWIRE_ETCD_KEY": certificates["client-key"]})
    assert seen == {"read": True, "members": ["holder-1", "reader-0"]}, seen


def test_a_member_without_the_client_certificate_or_trusting_another_ca_fails_init_typed(tls_etcd, monkeypatch):
    etcd, certificates = tls_etcd
    directory = f"etcd://127.0.0.1:{etcd.port}"
    no_certificate = _init_fails(monkeypatch, directory, {"TENSORWIRE_ETCD_CA": certificates["ca"]})
    assert isinstance(no_certificate, tw.AuthenticationError), no_certificate
    assert "TENSORWIRE_ETCD_CERT" in str(no_certificate), no_certificate
    other_ca = _init_fails(monkeypatch, directory, {
        "TENSORWIRE_ETCD_CA": certificates["other-ca"], "TENSORWIRE_ETCD_CERT": certificates["client"],
        "TENSORWIRE_ETCD_KEY": certificates["client-key"]})
    assert isinstance(other_ca, tw.AuthenticationError) and certificates["other-ca"] in str(other_ca), other_ca
    missing = _init_fails(monkeypatch, directory, {"TENSORWIRE_ETCD_CA": certificates["ca"] + ".missing"})
    assert isinstance(missing, tw.InvalidArgumentError) and "TENSORWIRE_ETCD_CA" in str(missing), missing
    mismatched = _init_fails(monkeypatch, directory, {
        "TENSORWIRE_ETCD_CA": certificates["ca"], "TENSORWIRE_ETCD_CERT": certificates["client"],
        "TENSORWIRE_ETCD_KEY": certificates["server-key"]})
    assert isinstance(mismatched, tw.InvalidArgumentError) and "TENSORWIRE_ETCD_KEY" in str(mismatched), mismatched
