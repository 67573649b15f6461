"""How a fleet member proves itself to an etcd cluster: etcd's user/password authentication and TLS.

``EtcdAccess`` is what ``etcd_store.py`` needs: the user and password (etcd's ``/v3/auth/authenticate`` turns them
into a token sent with every request), and TLS (``https``; the CA that signed etcd's server certificate; a client
certificate and key for etcd's ``--client-cert-auth``). ``etcd_access`` makes one of the directory URL
(``etcd://USER@...``, ``etcds://``; parsed by ``environment.py``) and of ``config.py`` (``TENSORWIRE_ETCD_*``).

The errors etcd answers with are typed here, by the gRPC status code of etcd's JSON error (``grpc_code``), and
TLS failures by the ``ssl`` exception under the HTTP client's (``tls_failure``), so that the store raises
``AuthenticationError`` saying what to check instead of retrying a request that can never succeed. Non-goals: JWT
token options (etcd's tokens of either kind are opaque here), certificate revocation lists.
"""

from __future__ import annotations

import json
import ssl
from dataclasses import dataclass, field

from ..errors import AuthenticationError, InvalidArgumentError, TensorwireError

__all__ = ["EtcdAccess", "etcd_access", "grpc_code", "tls_failure", "INVALID_ARGUMENT", "NOT_FOUND",
           "PERMISSION_DENIED", "UNAUTHENTICATED", "FAILED_PRECONDITION", "USER_EMPTY"]

# gRPC status codes (google.rpc.Code) that etcd's gateway puts in its JSON errors' "code".
INVALID_ARGUMENT = 3  # among others: wrong user or password; no user (auth enabled, no token sent)
NOT_FOUND = 5  # among others: a write under a lease that expired
PERMISSION_DENIED = 7  # the user's roles do not grant the key range
FAILED_PRECONDITION = 9  # among others: authentication is not enabled
UNAUTHENTICATED = 16  # the token is invalid or expired (etcd's --auth-token-ttl)
# etcd's own text for the one INVALID_ARGUMENT that means "send credentials" (rpctypes.ErrGRPCUserEmpty): compared
# whole, since its code alone is shared with malformed requests.
USER_EMPTY = "etcdserver: user name is empty"

# OpenSSL's X509_V_ERR_HOSTNAME_MISMATCH and X509_V_ERR_IP_ADDRESS_MISMATCH: a trusted certificate for another host.
_NAME_MISMATCH = (62, 64)
_PASSWORD_HELP = "TENSORWIRE_ETCD_PASSWORD (or TENSORWIRE_ETCD_PASSWORD_FILE)"


@dataclass(frozen=True)
class EtcdAccess:
    """Credentials and TLS of an etcd directory. Paths are PEM files; ``password`` is never shown in a repr."""

    user: str | None = None
    password: str | None = field(default=None, repr=False)
    tls: bool = False
    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    @property
    def protocol(self) -> str:
        return "https" if self.tls else "http"

    def check_files(self) -> None:
        """Load the CA and the client certificate once, so that a wrong path or file fails here, naming it
        (``InvalidArgumentError``), not as an unexplained TLS failure on the first request."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        if self.ca is not None:
            try:
                context.load_verify_locations(cafile=self.ca)
            except (OSError, ssl.SSLError) as e:
                raise InvalidArgumentError(
                    f"init: TENSORWIRE_ETCD_CA={self.ca!r} is not a readable PEM certificate ({_said(e)}); give the "
                    "CA certificate that signed etcd's server certificate (etcd's --trusted-ca-file)") from None
        if self.cert is not None:
            try:
                context.load_cert_chain(self.cert, self.key)
            except (OSError, ssl.SSLError) as e:
                raise InvalidArgumentError(
                    f"init: TENSORWIRE_ETCD_CERT={self.cert!r} with TENSORWIRE_ETCD_KEY={self.key!r} is not a "
                    f"usable client certificate and key ({_said(e)}); give PEM files of one certificate and its "
                    "private key (unencrypted)") from None


def etcd_access(url_user: str | None, url_tls: bool, *, user: str | None, password: str | None, ca: str | None,
                cert: str | None, key: str | None) -> EtcdAccess:
    """The access of an etcd directory: the user named in its URL or ``user`` (``TENSORWIRE_ETCD_USER``), which
    must agree; the password only from ``password`` (``config.py``); TLS when the URL says ``etcds://`` or a CA or
    a client certificate is given. ``InvalidArgumentError`` for a combination that cannot work."""
    if url_user is not None and user is not None and url_user != user:
        raise InvalidArgumentError(f"init: the directory URL names etcd user {url_user!r} but TENSORWIRE_ETCD_USER="
                                   f"{user!r}; name one user (or the same in both)")
    user = url_user or user
    if password is not None and user is None:
        raise InvalidArgumentError(f"init: {_PASSWORD_HELP} is set but no etcd user is named; name it in "
                                   "TENSORWIRE_ETCD_USER or the URL (etcd://USER@HOST:PORT)")
    if user is not None and password is None:
        raise InvalidArgumentError(
            f"init: etcd user {user!r} has no password; set {_PASSWORD_HELP} (with a client certificate alone, etcd "
            "takes the user from its common name: then name no user)")
    if key is not None and cert is None:
        raise InvalidArgumentError(f"init: TENSORWIRE_ETCD_KEY={key!r} is set without TENSORWIRE_ETCD_CERT; give the "
                                   "client certificate too")
    return EtcdAccess(user=user, password=password, tls=url_tls or ca is not None or cert is not None, ca=ca,
                      cert=cert, key=key)


def grpc_code(detail_text: str | None) -> tuple[int | None, str]:
    """``(code, error)`` of etcd's JSON error body (``{"error": ..., "code": N}``); ``(None, "")`` when the body is
    not one (a proxy's page, a connection failure's text)."""
    try:
        body = json.loads(detail_text or "")
    except ValueError:
        return None, ""
    if not isinstance(body, dict) or not isinstance(body.get("code"), int):
        return None, ""
    return body["code"], str(body.get("error", ""))


def tls_failure(error: BaseException, access: EtcdAccess, endpoint: str) -> TensorwireError | None:
    """What a TLS failure talking to ``endpoint`` means, as a typed error saying what to check; None when
    ``error`` (a ``requests`` connection error) holds no ``ssl`` error."""
    found = _ssl_error(error)
    if found is None:
        return None
    if isinstance(found, ssl.SSLCertVerificationError):
        if found.verify_code in _NAME_MISMATCH:
            return AuthenticationError(
                f"etcd: the certificate of etcd at {endpoint} is not for that host ({found.verify_message}); give "
                "etcd a server certificate whose subject alternative names hold the host of the directory URL, or "
                "name etcd in the URL as its certificate does")
        trusted = f"the CA in TENSORWIRE_ETCD_CA={access.ca!r}" if access.ca else "the system's CAs"
        return AuthenticationError(
            f"etcd: the certificate of etcd at {endpoint} does not verify against {trusted} ({found.verify_message}); "
            "set TENSORWIRE_ETCD_CA to the CA that signed etcd's --cert-file")
    reason = getattr(found, "reason", None) or ""
    if reason in ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG"):
        return InvalidArgumentError(
            f"etcd: {endpoint} does not speak TLS ({reason}); its client URLs are http://: use etcd:// "
            "without TENSORWIRE_ETCD_CA/CERT, or serve TLS (etcd --cert-file/--key-file)")
    if "CERTIFICATE" in reason:  # the server's alert: certificate required, bad, unknown CA, expired
        given = f"TENSORWIRE_ETCD_CERT={access.cert!r}" if access.cert else "no client certificate"
        return AuthenticationError(
            f"etcd: {endpoint} refused this member's TLS client certificate ({reason}; {given}); etcd runs "
            "with --client-cert-auth: set TENSORWIRE_ETCD_CERT and TENSORWIRE_ETCD_KEY to a certificate signed by "
            "its --trusted-ca-file")
    return AuthenticationError(f"etcd: the TLS handshake with {endpoint} failed ({reason or found}); check "
                               "TENSORWIRE_ETCD_CA, TENSORWIRE_ETCD_CERT and TENSORWIRE_ETCD_KEY")


def _ssl_error(error: BaseException) -> ssl.SSLError | None:
    """The ``ssl.SSLError`` under an HTTP client's exception: urllib3 and requests wrap it in their own (in
    ``args``, ``reason``, or the exception chain)."""
    seen, pending = set(), [error]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, ssl.SSLError):
            return current
        nested = [*getattr(current, "args", ()), getattr(current, "reason", None), current.__cause__,
                  current.__context__]
        pending.extend(item for item in nested if isinstance(item, BaseException))
    return None


def _said(e: Exception) -> str:
    return getattr(e, "strerror", None) or getattr(e, "reason", None) or str(e) or type(e).__name__
