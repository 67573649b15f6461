"""How an etcd directory's credentials are given: the URL (``etcd://USER@...``, ``etcds://``; a password in it
refused without being echoed), the ``TENSORWIRE_ETCD_*`` variables read by ``config.py``, and the combination of
both (``etcd_access``), each bad combination refused naming what to set; etcd's JSON errors read by their code."""

from __future__ import annotations

import os

import pytest

import tensorwire as tw
from tensorwire import config
from tensorwire.environment import DirectoryAddress, parse_directory, resolve_environment
from tensorwire.meeting.etcd_access import EtcdAccess, etcd_access, grpc_code


@pytest.fixture
def clean_env(monkeypatch):
    for name in [name for name in os.environ if name.startswith("TENSORWIRE_")]:
        monkeypatch.delenv(name)
    return monkeypatch


# --- the URL -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("url, expected", [
    ("tcp://10.0.0.1:7000", DirectoryAddress("tcp", (("10.0.0.1", 7000),))),
    ("etcd://a:2379,b:2380", DirectoryAddress("etcd", (("a", 2379), ("b", 2380)))),
    ("etcd://fleet@a:2379,[::1]:2380", DirectoryAddress("etcd", (("a", 2379), ("::1", 2380)), "fleet")),
    ("etcds://a:2379", DirectoryAddress("etcd", (("a", 2379),), None, True)),
    ("etcds://fleet@a:2379", DirectoryAddress("etcd", (("a", 2379),), "fleet", True)),
])
def test_directory_urls(url, expected):
    assert parse_directory(url) == expected


def test_a_password_in_the_url_is_refused_and_not_echoed():
    with pytest.raises(tw.InvalidArgumentError) as info:
        parse_directory("etcd://fleet:s3cret-pw@a:2379,b:2379")
    message = str(info.value)
    assert "s3cret-pw" not in message, message
    assert "fleet:***@" in message and "TENSORWIRE_ETCD_PASSWORD" in message and "_FILE" in message, message


@pytest.mark.parametrize("url", ["tcp://fleet@a:7000", "etcd://@a:2379", "etcdx://a:2379", "etcds://a"])
def test_bad_directory_urls_are_refused(url):
    with pytest.raises(tw.InvalidArgumentError, match="etcd://"):
        parse_directory(url)


def test_the_user_and_tls_reach_the_environment():
    env = resolve_environment(directory="etcds://fleet@a:2379,b:2379", name="decode-0")
    assert (env.etcd, env.etcd_user, env.etcd_tls) == ((("a", 2379), ("b", 2379)), "fleet", True)
    assert (env.master_addr, env.master_port) == ("a", 2379)


# --- the variables -------------------------------------------------------------------------------------------
def test_config_reads_the_etcd_variables_and_never_shows_the_password(clean_env):
    for name, value in {"USER": "fleet", "PASSWORD": "pw-123", "CA": "/ca.pem", "CERT": "/c.pem",
                        "KEY": "/k.pem"}.items():
        clean_env.setenv(f"TENSORWIRE_ETCD_{name}", value)
    cfg = config.load()
    assert (cfg.etcd_user, cfg.etcd_password, cfg.etcd_ca, cfg.etcd_cert, cfg.etcd_key) == (
        "fleet", "pw-123", "/ca.pem", "/c.pem", "/k.pem")
    assert "pw-123" not in repr(cfg)


def test_config_reads_the_password_from_a_file(clean_env, tmp_path):
    path = tmp_path / "password"
    path.write_text("from-a-file\nsecond line ignored\n")
    clean_env.setenv("TENSORWIRE_ETCD_PASSWORD_FILE", str(path))
    assert config.load().etcd_password == "from-a-file"


@pytest.mark.parametrize("case, text", [
    ("both", "unset one"), ("missing", "cannot be read"), ("empty", "holds no password")])
def test_config_refuses_a_bad_password_file(clean_env, tmp_path, case, text):
    path = tmp_path / "password"
    if case == "both":
        path.write_text("x\n")
        clean_env.setenv("TENSORWIRE_ETCD_PASSWORD", "y")
    elif case == "empty":
        path.write_text("\n")
    clean_env.setenv("TENSORWIRE_ETCD_PASSWORD_FILE", str(path))
    with pytest.raises(tw.InvalidArgumentError, match="TENSORWIRE_ETCD_PASSWORD") as info:
        config.load()
    assert text in str(info.value)


# --- URL and variables together ------------------------------------------------------------------------------
def _access(url_user=None, url_tls=False, **given) -> EtcdAccess:
    return etcd_access(url_user, url_tls, **{"user": None, "password": None, "ca": None, "cert": None, "key": None,
                                             **given})


def test_access_combines_the_url_and_the_variables():
    assert _access() == EtcdAccess()
    assert _access("fleet", password="pw") == EtcdAccess(user="fleet", password="pw")
    assert _access(user="fleet", password="pw") == EtcdAccess(user="fleet", password="pw")
    assert _access("fleet", user="fleet", password="pw").user == "fleet"
    assert _access(url_tls=True) == EtcdAccess(tls=True)
    assert _access(ca="/ca.pem").tls and _access(cert="/c.pem").tls  # a CA or a certificate means TLS
    assert _access(cert="/c.pem").protocol == "https" and _access().protocol == "http"


@pytest.mark.parametrize("url_user, given, text", [
    ("fleet", {"user": "other", "password": "pw"}, "name one user"),
    (None, {"password": "pw"}, "no etcd user is named"),
    ("fleet", {}, "has no password"),
    (None, {"user": "fleet"}, "has no password"),
    (None, {"key": "/k.pem"}, "without TENSORWIRE_ETCD_CERT"),
])
def test_access_refuses_what_cannot_work(url_user, given, text):
    with pytest.raises(tw.InvalidArgumentError, match=text) as info:
        _access(url_user, **given)
    assert "pw" not in str(info.value).replace("password", "")


def test_a_missing_certificate_file_is_named(tmp_path):
    missing = str(tmp_path / "ca.pem")
    with pytest.raises(tw.InvalidArgumentError, match="TENSORWIRE_ETCD_CA") as info:
        EtcdAccess(tls=True, ca=missing).check_files()
    assert missing in str(info.value)


def test_init_refuses_a_password_without_a_user_before_reaching_etcd(clean_env):
    clean_env.setenv("TENSORWIRE_ETCD_PASSWORD", "pw")
    with pytest.raises(tw.InvalidArgumentError, match="TENSORWIRE_ETCD_USER"):
        tw.init(directory="etcd://127.0.0.1:1", name="decode-0", timeout=5)


# --- etcd's answers ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("body, expected", [
    ('{"error":"etcdserver: invalid auth token","message":"etcdserver: invalid auth token","code":16}',
     (16, "etcdserver: invalid auth token")),
    ('{"error":"etcdserver: permission denied","code":7}', (7, "etcdserver: permission denied")),
    ("Client sent an HTTP request to an HTTPS server.", (None, "")),
    (None, (None, "")),
    ('{"code":"16"}', (None, "")),
])
def test_grpc_code(body, expected):
    assert grpc_code(body) == expected
