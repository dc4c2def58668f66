"""HTTPS for `localm serve`: the local CA and its certificates, GET /localm-ca.crt, the
owner's own pair, start-up refusals, and clients (the openai SDK, the `localm` commands, the
test helpers) over real HTTPS on a loopback port."""

from __future__ import annotations

import datetime
import importlib.util
import ipaddress
import json
import os
import socket
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import httpx
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from conftest import offline_cli
from localm.kernel import tls
from localm.sdk.testing import LocalmServer

MODEL = "smollm2-135m-instruct"
TLS_KEYS = ("tls_enabled", "tls_cert", "tls_key")
HAS_LLAMA = importlib.util.find_spec("llama_cpp") is not None


def strict(cafile: Path | str) -> ssl.SSLContext:
    """A client context trusting ``cafile`` with the checks Python 3.13 makes by default
    (``VERIFY_X509_STRICT``), which a loosely made CA fails."""
    context = ssl.create_default_context(cafile=str(cafile))
    context.verify_flags |= ssl.VERIFY_X509_STRICT
    return context


@pytest.fixture(scope="module")
def keyed(module_server: Callable[..., LocalmServer]) -> tuple[LocalmServer, str, str]:
    """A real `localm serve` process with tls_enabled on, the default model, an owner key and
    a (non-owner) config:write key."""
    keys: dict[str, str] = {}

    def prepare(data_dir: Path) -> None:
        offline_cli(data_dir, "config", "set", "tls_enabled", "true")
        keys["owner"] = offline_cli(data_dir, "key", "generate").strip()
        keys["writer"] = offline_cli(data_dir, "key", "create", "--name", "w", "--scope", "config:write").strip()

    plugins = ["chat", "openai", "llamacpp"] if HAS_LLAMA else ["chat", "openai"]
    s = module_server(prepare=prepare, plugins=plugins, process=True)
    return s, keys["owner"], keys["writer"]


def test_serves_https_and_says_so(keyed: tuple[LocalmServer, str, str]) -> None:
    s, owner, _ = keyed
    assert s.url == f"https://127.0.0.1:{s.port}"
    assert f"localm serving on https://127.0.0.1:{s.port} " in s.log()
    with pytest.raises(httpx.HTTPError):  # plain HTTP to the port is no way in
        httpx.get(f"http://127.0.0.1:{s.port}/health", timeout=5)
    # the test helper's client trusts the data dir's CA
    assert s.client(owner).get("/v1/config").json()["tls_enabled"] is True


def test_openai_sdk_trusting_the_fetched_ca(keyed: tuple[LocalmServer, str, str], tmp_path: Path) -> None:
    s, owner, _ = keyed
    # first contact: the CA is fetched without verification (as `curl -k` would), then compared
    # with the one in the data dir, as a user compares its fingerprint
    fetched = httpx.get(f"{s.url}/localm-ca.crt", verify=False, timeout=10)
    assert fetched.status_code == 200
    ca_file = tmp_path / "localm-ca.crt"
    ca_file.write_bytes(fetched.content)
    on_disk = x509.load_pem_x509_certificate((s.data_dir / "tls" / "ca.crt").read_bytes())
    assert x509.load_pem_x509_certificate(fetched.content).fingerprint(hashes.SHA256()) == on_disk.fingerprint(
        hashes.SHA256())
    client = openai.OpenAI(base_url=f"{s.url}/v1", api_key=owner, max_retries=0,
                           http_client=httpx.Client(verify=strict(ca_file), timeout=120))
    assert MODEL in [m.id for m in client.models.list()]
    if not HAS_LLAMA:
        pytest.skip("llama-cpp-python is not installed: no chat completion")
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                           max_tokens=4, temperature=0)
    assert reply.choices[0].message.content and reply.usage is not None and reply.usage.completion_tokens >= 1


def test_the_documented_openai_client_runs(keyed: tuple[LocalmServer, str, str], tmp_path: Path) -> None:
    """docs/serving.md's https_client.py, as written there, against this HTTPS server (its
    documented address replaced by the server's own), beside the CA the server handed out."""
    import re

    page = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text()
    block = re.search(r'```python title="https_client.py"\n(.*?)\n```', page, re.S)
    assert block is not None, "docs/serving.md has no https_client.py"
    s, owner, _ = keyed
    assert "https://127.0.0.1:8642/v1" in block.group(1)
    (tmp_path / "https_client.py").write_text(block.group(1).replace("https://127.0.0.1:8642", s.url))
    (tmp_path / "localm-ca.crt").write_bytes(s.client().get("/localm-ca.crt").content)
    env = {**{k: v for k, v in os.environ.items() if k != "LOCALM_API_KEY"}, "LOCALM_KEY": owner}
    out = subprocess.run([sys.executable, "https_client.py"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0 and MODEL in out.stdout, out.stderr


def test_a_client_without_the_ca_is_refused(keyed: tuple[LocalmServer, str, str], tmp_path: Path) -> None:
    s, owner, _ = keyed
    client = openai.OpenAI(base_url=f"{s.url}/v1", api_key=owner, max_retries=0)
    with pytest.raises(openai.APIConnectionError) as refused:
        client.models.list()
    assert "CERTIFICATE_VERIFY_FAILED" in repr(refused.value.__cause__)
    # nor does another CA get it through
    other = tmp_path / "other-ca.crt"
    other.write_bytes(_ca("someone else")[1].public_bytes(serialization.Encoding.PEM))
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"{s.url}/health", verify=ssl.create_default_context(cafile=str(other)))


def test_ca_route_is_public_and_only_ever_a_certificate(keyed: tuple[LocalmServer, str, str]) -> None:
    s, _, _ = keyed
    anonymous = s.client()
    assert anonymous.get("/v1/config").status_code == 401  # keys exist: the rest needs one
    r = anonymous.get("/localm-ca.crt")
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-x509-ca-cert")
    assert b"PRIVATE KEY" not in r.content and r.content.count(b"-----BEGIN") == 1
    ca = x509.load_pem_x509_certificate(r.content)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value == x509.BasicConstraints(True, 0)
    usage = ca.extensions.get_extension_for_class(x509.KeyUsage)
    assert usage.critical and usage.value.key_cert_sign
    # the private keys sit beside it: no spelling of a path reaches them
    for path in ("/localm-ca.crt/../tls/ca.key", "/localm-ca.key", "/tls/ca.key", "/localm-ca.crt%2f..%2fca.key",
                 "/localm-ca.crt?file=ca.key", "/localm-ca.crt/", "/LOCALM-CA.CRT"):
        got = anonymous.get(path)
        assert b"PRIVATE KEY" not in got.content, path


def test_the_session_cookie_is_secure_over_https(keyed: tuple[LocalmServer, str, str]) -> None:
    s, owner, _ = keyed
    r = s.client().post("/api/session", json={"key": owner})
    assert r.status_code == 200
    cookie = r.headers["set-cookie"].lower()
    assert "localm_session=" in cookie and "; secure" in cookie and "httponly" in cookie


def test_key_files_are_private_and_sans_name_this_machine(keyed: tuple[LocalmServer, str, str]) -> None:
    s, _, _ = keyed
    folder = s.data_dir / "tls"
    assert folder.stat().st_mode & 0o777 == 0o700
    assert (folder / "ca.key").stat().st_mode & 0o777 == 0o600
    assert (folder / "server.key").stat().st_mode & 0o777 == 0o600
    cert = x509.load_pem_x509_certificate((folder / "server.crt").read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    names = sans.get_values_for_type(x509.DNSName)
    assert "localhost" in names and socket.gethostname().lower() in names
    loopback = {ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")}
    assert loopback <= set(sans.get_values_for_type(x509.IPAddress))
    ca = x509.load_pem_x509_certificate((folder / "ca.crt").read_bytes())
    cert.verify_directly_issued_by(ca)
    # what the server presents is that certificate, verified by name against the CA
    with socket.create_connection(("127.0.0.1", s.port)) as raw, \
            strict(folder / "ca.crt").wrap_socket(raw, server_hostname="localhost") as conn:
        presented = conn.getpeercert(binary_form=True)
    assert x509.load_der_x509_certificate(presented) == cert


def test_a_config_write_key_neither_sees_nor_sets_tls(keyed: tuple[LocalmServer, str, str]) -> None:
    s, owner, writer = keyed
    w = s.client(writer)
    shown = w.get("/v1/config").json()
    assert not any(key in shown for key in TLS_KEYS)
    schema = [f["key"] for f in w.get("/v1/config/schema").json()["fields"]]
    assert not any(key in schema for key in TLS_KEYS)
    before = (s.data_dir / "config.json").read_bytes()
    for body in ({"tls_enabled": False}, {"tls_cert": "/tmp/mine.pem"}, {"tls_key": "/tmp/mine.key"},
                 {"suggest_plugins": False, "tls_enabled": None}):
        r = w.patch("/v1/config", json=body)
        assert r.status_code == 403, (body, r.text)
        assert "owner-only" in r.json()["detail"]
    assert (s.data_dir / "config.json").read_bytes() == before
    assert s.client(owner).get("/v1/config").json()["tls_enabled"] is True
    # the owner's own pair is named by absolute paths, checked when it is set
    for key in ("tls_cert", "tls_key"):
        r = s.client(owner).patch("/v1/config", json={key: "certs/mine.pem"})
        assert r.status_code == 400 and "absolute path" in r.json()["detail"]
    assert (s.data_dir / "config.json").read_bytes() == before


def test_localm_commands_reach_their_https_server(keyed: tuple[LocalmServer, str, str]) -> None:
    s, _, _ = keyed
    info = json.loads((s.data_dir / "server.json").read_text())
    assert info["url"] == s.url and info["tls"] == {"trust": str(s.data_dir / "tls" / "ca.crt"), "own": False}
    # `localm jobs list` answers only from a running server: it reached it over HTTPS
    for process in (False, True):
        r = s.cli("jobs", "list", process=process)
        assert r.returncode == 0 and "No localm server is running" not in r.stdout, r.stderr + r.stdout
    r = s.cli("config", "get", "tls_enabled")
    assert r.returncode == 0 and r.stdout.strip() == "true"
    if HAS_LLAMA:  # `localm run` (the chat plugin's command) streams a reply over HTTPS too
        r = s.cli("run", MODEL, "-p", "max_tokens", "4", "-p", "temperature", "0", "Say hi.", input="", process=True)
        assert r.returncode == 0 and r.stdout.strip() and r.stderr == "", r.stderr


# --- start-up refusals ----------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve_refused(data_dir: Path) -> subprocess.CompletedProcess[str]:
    """`localm serve` on a free port: it must exit non-zero before anything listens."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "LOCALM_API_KEY"}
    proc = subprocess.run([sys.executable, "-m", "localm.kernel", "--data-dir", str(data_dir), "serve",
                           "--plugins", "", "--port", str(port)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0, "something listens on the port"
    assert not (data_dir / "server.json").exists()
    return proc


def _ca(name: str) -> tuple[Any, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def _pair(folder: Path, names: tuple[str, ...] = ("localhost",), ips: tuple[str, ...] = ("127.0.0.1",),
          ca_pair: tuple[Any, x509.Certificate] | None = None) -> tuple[Path, Path, Path]:
    """A server certificate for ``names`` and ``ips`` signed by ``ca_pair`` (a new CA of the
    test's own by default): the CA file, the certificate file (the CA after it, as a chain)
    and the key file."""
    ca_key, ca = ca_pair or _ca("test CA")
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
            .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.SubjectAlternativeName([*map(x509.DNSName, names),
                                                        *(x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips)]),
                           critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "ca.key").write_bytes(ca_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    paths = folder / "my-ca.pem", folder / "my-cert.pem", folder / "my-key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM) + ca.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    paths[2].chmod(0o600)
    return paths


@pytest.mark.parametrize("case", ["missing cert", "cert not PEM", "key not PEM", "key of another cert",
                                  "key without cert", "encrypted key", "relative path", "a folder"])
def test_a_bad_own_pair_is_a_startup_error_and_nothing_listens(tmp_path: Path, case: str) -> None:
    ca, cert, key = _pair(tmp_path)
    _, _, other_key = _pair(tmp_path / "other")
    settings: dict[str, Any] = {"tls_enabled": True, "tls_cert": str(cert), "tls_key": str(key)}
    if case == "missing cert":
        settings["tls_cert"] = str(tmp_path / "nowhere" / "cert.pem")
        expect = f"tls_cert {tmp_path / 'nowhere' / 'cert.pem'}: no such file"
    elif case == "cert not PEM":
        key.with_name("junk.pem").write_bytes(b"\x00\x01 not a certificate")
        settings["tls_cert"] = str(key.with_name("junk.pem"))
        expect = f"tls_cert {key.with_name('junk.pem')} is not a PEM certificate"
    elif case == "key not PEM":
        settings["tls_key"] = str(ca)  # a certificate, not a key
        expect = f"tls_key {ca} is not a PEM private key"
    elif case == "key of another cert":
        settings["tls_key"] = str(other_key)
        expect = f"tls_key {other_key} does not match the certificate in tls_cert {cert}"
    elif case == "key without cert":
        del settings["tls_cert"]
        expect = "tls_key is set but tls_cert is empty"
    elif case == "encrypted key":
        private = serialization.load_pem_private_key(key.read_bytes(), password=None)
        key.write_bytes(private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                              serialization.BestAvailableEncryption(b"secret")))
        expect = f"tls_key {key} is encrypted"
    elif case == "relative path":
        settings["tls_cert"] = "my-cert.pem"
        expect = "tls_cert my-cert.pem is not an absolute path"
    else:
        settings["tls_key"] = str(tmp_path / "other")
        expect = f"tls_key {tmp_path / 'other'} is not a file"
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "config.json").write_text(json.dumps(settings))
    proc = _serve_refused(data_dir)
    assert f"Error: {expect}" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (data_dir / "tls").exists()  # no fallback to localm's own pair either


@pytest.mark.parametrize("config, expect", [
    (b'{"tls_enabled": true, oops', "config.json cannot be read, so whether HTTPS (tls_enabled) is on is unknown"),
    (b'{"tls_enabled": "yes"}', "tls_enabled in config.json must be true or false, not 'yes'"),
])
def test_a_config_that_cannot_say_is_no_silent_http(tmp_path: Path, config: bytes, expect: str) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "config.json").write_bytes(config)
    proc = _serve_refused(data_dir)
    assert expect in proc.stderr, proc.stderr
    assert (data_dir / "config.json").read_bytes() == config


def test_a_damaged_ca_is_an_error_and_never_replaced(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    tls.localm_pair(data_dir, "127.0.0.1")
    ca_key = data_dir / "tls" / "ca.key"
    ca_key.write_bytes(ca_key.read_bytes()[:-40])
    before = {p.name: p.read_bytes() for p in (data_dir / "tls").iterdir()}
    (data_dir / "config.json").write_text(json.dumps({"tls_enabled": True}))
    proc = _serve_refused(data_dir)
    assert f"The localm CA in {data_dir / 'tls'} is damaged: ca.key" in proc.stderr, proc.stderr
    assert {p.name: p.read_bytes() for p in (data_dir / "tls").iterdir()} == before


# --- the certificates over time ------------------------------------------------------------

def _sans(path: Path) -> x509.SubjectAlternativeName:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    return cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value


def test_the_server_certificate_follows_the_bind_host_and_expiry_but_the_ca_stays(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data_dir = tmp_path / "data"
    first = tls.localm_pair(data_dir, "127.0.0.1")
    folder = data_dir / "tls"
    assert first == tls.Tls(cert=folder / "server.crt", key=folder / "server.key", trust=folder / "ca.crt", own=False)
    ca_before, cert_before = (folder / "ca.crt").read_bytes(), (folder / "server.crt").read_bytes()
    tls.localm_pair(data_dir, "127.0.0.1")
    assert (folder / "server.crt").read_bytes() == cert_before  # still good: kept
    tls.localm_pair(data_dir, "0.0.0.0")  # every interface: nothing more to name
    assert (folder / "server.crt").read_bytes() == cert_before
    tls.localm_pair(data_dir, "192.0.2.7")
    assert ipaddress.ip_address("192.0.2.7") in _sans(folder / "server.crt").get_values_for_type(x509.IPAddress)
    tls.localm_pair(data_dir, "ai.home.lan")
    assert "ai.home.lan" in _sans(folder / "server.crt").get_values_for_type(x509.DNSName)
    named = x509.load_pem_x509_certificate((folder / "server.crt").read_bytes())
    monkeypatch.setattr(tls, "RENEW_DAYS", tls.SERVER_DAYS + 1)  # every certificate is now near its end
    tls.localm_pair(data_dir, "ai.home.lan")
    assert x509.load_pem_x509_certificate((folder / "server.crt").read_bytes()).serial_number != named.serial_number
    assert (folder / "ca.crt").read_bytes() == ca_before
    # a server certificate someone replaced with another CA's is made again, by localm's CA
    (folder / "server.crt").write_bytes(_ca("impostor")[1].public_bytes(serialization.Encoding.PEM))
    monkeypatch.setattr(tls, "RENEW_DAYS", 30)
    tls.localm_pair(data_dir, "ai.home.lan")
    x509.load_pem_x509_certificate((folder / "server.crt").read_bytes()).verify_directly_issued_by(
        x509.load_pem_x509_certificate(ca_before))
    assert (folder / "ca.crt").read_bytes() == ca_before
    assert (folder / "server.key").stat().st_mode & 0o777 == 0o600


def test_a_first_run_stopped_before_the_ca_certificate_starts_over(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    (data_dir / "tls").mkdir(parents=True)
    (data_dir / "tls" / "ca.key").write_bytes(b"half of a first run")
    made = tls.localm_pair(data_dir, "127.0.0.1")
    assert b"PRIVATE KEY" in (data_dir / "tls" / "ca.key").read_bytes()
    x509.load_pem_x509_certificate(made.cert.read_bytes()).verify_directly_issued_by(
        x509.load_pem_x509_certificate(made.trust.read_bytes()))


# --- the owner's own pair -------------------------------------------------------------

def test_the_owners_own_pair_is_served(server: Callable[..., LocalmServer], tmp_path: Path) -> None:
    ca, cert, key = _pair(tmp_path / "mine", names=("ai.home.lan",), ips=())  # it does not name 127.0.0.1
    data_dir = tmp_path / "data"
    for name, value in (("tls_enabled", "true"), ("tls_cert", str(cert)), ("tls_key", str(key))):
        offline_cli(data_dir, "config", "set", name, value)
    offline_cli(data_dir, "key", "generate")
    s = server(data_dir=data_dir, plugins=[])  # in this process: the test helper serves HTTPS too
    assert s.url.startswith("https://")
    # a client trusting the owner's CA reaches it by the name the certificate holds
    with socket.create_connection(("127.0.0.1", s.port)) as raw, \
            ssl.create_default_context(cafile=str(ca)).wrap_socket(raw, server_hostname="ai.home.lan") as conn:
        presented = conn.getpeercert(binary_form=True)
    assert x509.load_der_x509_certificate(presented) == x509.load_pem_x509_certificate(cert.read_bytes())
    r = s.client().get("/localm-ca.crt")  # public, and there is no localm CA to hand out
    assert r.status_code == 404 and r.json()["code"] == "no_localm_ca" and "tls_cert" in r.json()["detail"]
    assert not (data_dir / "tls").exists()
    # the `localm` commands (and the test helper's client) trust that very certificate on
    # loopback, though it does not name 127.0.0.1 ...
    assert json.loads((data_dir / "server.json").read_text())["tls"] == {"trust": str(cert), "own": True}
    r = s.cli("jobs", "list")
    assert r.returncode == 0 and "No localm server is running" not in r.stdout, r.stderr + r.stdout
    assert s.owner().get("/v1/config").json()["tls_cert"] == str(cert)


def _tls_listener(cert: Path, key: Path) -> tuple[int, Callable[[], None]]:
    """A loopback TLS server presenting ``cert`` to each connection it accepts: its port, and
    a function that stops it."""
    import threading

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(cert), str(key))
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stopping = threading.Event()

    def serve() -> None:
        while not stopping.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            try:
                with context.wrap_socket(conn, server_side=True):
                    pass
            except (OSError, ssl.SSLError):
                pass
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()

    def stop() -> None:
        stopping.set()
        thread.join(5)
        listener.close()
    return listener.getsockname()[1], stop


def test_a_local_client_trusts_the_owners_certificate_itself_not_its_whole_ca(tmp_path: Path) -> None:
    """The `localm` commands reach a server with the owner's own certificate on loopback without
    checking its names: so they trust that one certificate, never every one its CA signed (a
    program squatting the port with another of them gets no attach token)."""
    ca_file, cert, key = _pair(tmp_path / "mine", names=("ai.home.lan",), ips=())
    pinned = tls.client_context(cert, own=True)
    port, stop = _tls_listener(cert, key)
    try:
        with socket.create_connection(("127.0.0.1", port)) as raw, pinned.wrap_socket(raw) as conn:
            assert conn.version() is not None
    finally:
        stop()
    # another certificate of the same CA, for the same name
    ca_pair = (serialization.load_pem_private_key((tmp_path / "mine" / "ca.key").read_bytes(), None),
               x509.load_pem_x509_certificate(ca_file.read_bytes()))
    _, sibling_cert, sibling_key = _pair(tmp_path / "sibling", names=("ai.home.lan",), ips=(), ca_pair=ca_pair)
    port, stop = _tls_listener(sibling_cert, sibling_key)
    try:
        with socket.create_connection(("127.0.0.1", port)) as raw, pytest.raises(ssl.SSLCertVerificationError):
            pinned.wrap_socket(raw)
    finally:
        stop()


def test_restart_in_place_keeps_https_and_the_ca(server: Callable[..., LocalmServer], tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    offline_cli(data_dir, "config", "set", "tls_enabled", "true")
    s = server(data_dir=data_dir, plugins=[], process=True)
    ca = (data_dir / "tls" / "ca.crt").read_bytes()
    old = s.token
    assert s.owner().post("/v1/server/restart").json() == {"restarting": True}
    s.wait_restarted(old)
    assert s.url.startswith("https://") and "localm restarted on https://" in s.log()
    assert s.owner().get("/v1/config").json()["tls_enabled"] is True
    assert (data_dir / "tls" / "ca.crt").read_bytes() == ca


def test_a_plain_server_has_no_ca_and_loads_no_cryptography(tmp_path: Path) -> None:
    """Without tls_enabled the server is HTTP, GET /localm-ca.crt is a 404 and starting it
    never imports cryptography (checked in a fresh interpreter)."""
    script = (
        "import sys, pathlib\n"
        "from localm.sdk.testing import LocalmServer\n"
        f"s = LocalmServer(pathlib.Path({str(tmp_path / 'data')!r}), plugins=[], process=False).start()\n"
        "r = s.client().get('/localm-ca.crt')\n"
        "print(s.url.split(':')[0], r.status_code, r.json()['code'], 'cryptography' in sys.modules)\n"
        "s.stop()\n")
    env = {k: v for k, v in os.environ.items() if k != "LOCALM_API_KEY"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["http", "404", "no_localm_ca", "False"]
