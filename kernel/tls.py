"""HTTPS for ``localm serve``: a local CA and a server certificate it signs, or the owner's
own certificate and key (the ``tls_cert`` and ``tls_key`` settings).

```
<data dir>/tls/ca.crt       the local CA's certificate: what clients trust (GET /localm-ca.crt)
<data dir>/tls/ca.key       its private key (0600); it signs only this server's certificates
<data dir>/tls/server.crt   the server certificate, signed by the CA
<data dir>/tls/server.key   its private key (0600)
```

The CA is made once and never replaced (clients trust it); the server certificate is made
again at start-up when it is near its end, no longer names the address the server binds,
or was not signed by the CA beside it. The owner's own pair is checked before anything
listens: a missing or unreadable file, one that is not PEM, or a key that does not match
the certificate stops the start with an error naming the setting, never a fall back to
plain HTTP.

Only the standard library is imported here; ``cryptography`` is imported by the functions
that make or read certificates, so a server without TLS never loads it.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import logging
import os
import socket
import ssl
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import attrs

from .errors import LocalmError
from .storage import atomic_write_bytes

log = logging.getLogger("localm")

TLS_DIR = "tls"
CA_CERT, CA_KEY, SERVER_CERT, SERVER_KEY = "ca.crt", "ca.key", "server.crt", "server.key"
#: A generated server certificate lasts this long (under the 398 days browsers accept) ...
SERVER_DAYS = 397
#: ... and is made again at start-up once it has fewer days than this left.
RENEW_DAYS = 30
CA_YEARS = 10
#: The most a certificate or key file may hold: checked before it is read.
MAX_PEM_BYTES = 1 << 20
#: Bind addresses that name no one address: the certificate names loopback and this machine.
WILDCARDS = ("0.0.0.0", "::", "")


@attrs.frozen
class ServerTls:
    """The pair ``localm serve`` serves, and what a local client trusts to reach it."""

    certfile: Path
    keyfile: Path
    #: PEM a client of this server trusts: the local CA, or the owner's own leaf certificate
    trust: str
    #: True for the owner's own certificate: a local client trusts that one certificate
    #: (it may not name 127.0.0.1) instead of a CA and a host name
    own: bool = False

    def server_json(self) -> dict[str, Any]:
        """What ``server.json`` records under ``tls`` for the ``localm`` commands."""
        return {"trust": self.trust, "pin": self.own}


def tls_dir(data_dir: Path) -> Path:
    return Path(data_dir) / TLS_DIR


# --- what a client trusts ----------------------------------------------------------------

def client_context(tls: Mapping[str, Any] | None) -> ssl.SSLContext | bool:
    """The ``verify`` for an httpx client of a server whose ``server.json`` holds ``tls``:
    True (the system's trust) for a plain-HTTP server; else a context trusting only what
    the server serves: its local CA (the host name checked), or exactly its owner's own
    certificate."""
    if not tls or not isinstance(tls.get("trust"), str):
        return True
    ctx = ssl.create_default_context(cadata=tls["trust"])
    if tls.get("pin"):
        # this one certificate is the anchor: whoever presents it holds its key
        ctx.check_hostname = False
        ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    return ctx


# --- names ---------------------------------------------------------------------------------

def wanted_names(bind_host: str) -> tuple[frozenset[str], frozenset[Any]]:
    """(DNS names, IP addresses) the server certificate must name: localhost, the loopback
    addresses, host.docker.internal, this machine's name (and NAME.local), and the bind
    address when it names one address or host."""
    names = {"localhost", "host.docker.internal"}
    addresses: set[Any] = {ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")}
    machine = socket.gethostname().strip().rstrip(".").lower()
    bind = bind_host.strip().strip("[]").rstrip(".").lower()
    for value in (machine, f"{machine}.local" if machine and "." not in machine else "",
                  "" if bind in WILDCARDS else bind):
        if not value:
            continue
        try:
            addresses.add(ipaddress.ip_address(value.split("%")[0]))
        except ValueError:
            names.add(value)
    return frozenset(names), frozenset(addresses)


# --- the local CA and the server certificate ------------------------------------------------

@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """One process at a time makes or checks the files of ``folder``."""
    import filelock

    folder.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        os.chmod(folder, 0o700)
    try:
        with filelock.FileLock(str(folder / "tls.lock"), timeout=30):
            yield
    except filelock.Timeout:
        raise LocalmError(504, f"{folder} is locked by another process; try again", code="tls_locked") from None


def _read_pem(path: Path, what: str) -> bytes:
    """The bytes of ``path``, bounded before they are read; a LocalmError naming ``what``."""
    try:
        st = path.stat()
        if not path.is_file():
            raise LocalmError(500, f"{what}: {path} is not a file", code="tls_invalid")
        if st.st_size > MAX_PEM_BYTES:
            raise LocalmError(500, f"{what}: {path} is larger than {MAX_PEM_BYTES} bytes: not a PEM file",
                              code="tls_invalid")
        with open(path, "rb") as fh:
            return fh.read(MAX_PEM_BYTES + 1)[:MAX_PEM_BYTES]
    except FileNotFoundError:
        raise LocalmError(500, f"{what}: {path} does not exist", code="tls_invalid") from None
    except OSError as exc:
        raise LocalmError(500, f"{what}: {path} cannot be read ({exc.strerror or exc})", code="tls_invalid") from None


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _new_key() -> Any:
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _cert_pem(cert: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


def _spki(public_key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def _make_ca() -> tuple[Any, Any]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    key = _new_key()
    machine = socket.gethostname().strip() or "this machine"
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "localm"),
                      x509.NameAttribute(NameOID.COMMON_NAME, f"localm local CA ({machine})"[:64])])
    now = _now()
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (x509.CertificateBuilder()
            .subject_name(name).issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=365 * CA_YEARS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(ski, critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
            .sign(key, hashes.SHA256()))
    return cert, key


def _make_server(ca_cert: Any, ca_key: Any, bind_host: str) -> tuple[Any, Any]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = _new_key()
    names, addresses = wanted_names(bind_host)
    now = _now()
    end = min(now + datetime.timedelta(days=SERVER_DAYS), ca_cert.not_valid_after_utc)
    san = [x509.DNSName(n) for n in sorted(names)] + [x509.IPAddress(a) for a in sorted(addresses, key=str)]
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "localm"),
                                     x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.SubjectAlternativeName(san), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return cert, key


def _load_ca(folder: Path) -> tuple[Any, Any] | None:
    """The local CA (certificate, key), or None when there is none yet. A CA certificate that
    is unreadable, expired or without its key stops here: clients trust it, so it is never
    replaced behind their back."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    cert_path, key_path = folder / CA_CERT, folder / CA_KEY
    if not cert_path.exists():
        return None  # a key without its certificate (a start killed between the two) is made again
    remedy = f"restore it, or remove {cert_path} and {key_path} to make a new CA (clients must then trust the new one)"
    try:
        cert = x509.load_pem_x509_certificate(_read_pem(cert_path, "the local CA"))
    except ValueError:
        raise LocalmError(500, f"the local CA: {cert_path} is not a PEM certificate; {remedy}",
                          code="tls_invalid") from None
    if not key_path.exists():
        raise LocalmError(500, f"the local CA: its key {key_path} is missing; {remedy}", code="tls_invalid")
    try:
        key = serialization.load_pem_private_key(_read_pem(key_path, "the local CA"), password=None)
    except (ValueError, TypeError):
        raise LocalmError(500, f"the local CA: {key_path} is not an unencrypted PEM private key; {remedy}",
                          code="tls_invalid") from None
    if _spki(key.public_key()) != _spki(cert.public_key()):
        raise LocalmError(500, f"the local CA: {key_path} does not match {cert_path}; {remedy}", code="tls_invalid")
    if cert.not_valid_after_utc <= _now() + datetime.timedelta(days=1):
        raise LocalmError(500, f"the local CA: {cert_path} has expired; remove {cert_path} and {key_path} to make "
                               "a new CA (clients must then trust the new one)", code="tls_invalid")
    return cert, key


def _ensure_ca(folder: Path) -> tuple[Any, Any]:
    """The local CA, made now when there is none (the caller holds the folder's lock)."""
    found = _load_ca(folder)
    if found is not None:
        return found
    cert, key = _make_ca()
    atomic_write_bytes(folder / CA_KEY, _key_pem(key), mode=0o600)  # the key first: a CA is whole once its cert is
    atomic_write_bytes(folder / CA_CERT, _cert_pem(cert), mode=0o644)
    log.info("made a local CA for HTTPS: %s (clients trust it; GET /localm-ca.crt serves it)", folder / CA_CERT)
    return cert, key


def ca_pem(data_dir: Path, *, create: bool) -> bytes | None:
    """The local CA's certificate as PEM (parsed and written out again: only a certificate
    ever leaves), made now when ``create`` and there is none; None when there is none."""
    folder = tls_dir(data_dir)
    if not create and not (folder / CA_CERT).exists():
        return None
    with _locked(folder):
        found = _ensure_ca(folder) if create else _load_ca(folder)
    return None if found is None else _cert_pem(found[0])


def _server_is_good(folder: Path, ca_cert: Any, bind_host: str) -> str | None:
    """None when the server certificate can be served as it is; else why it is made again."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        cert = x509.load_pem_x509_certificate(_read_pem(folder / SERVER_CERT, "the server certificate"))
        key = serialization.load_pem_private_key(_read_pem(folder / SERVER_KEY, "the server certificate"),
                                                 password=None)
    except LocalmError as exc:
        return exc.detail
    except (ValueError, TypeError):
        return "it is not a PEM certificate and key"
    if _spki(key.public_key()) != _spki(cert.public_key()):
        return "its key does not match it"
    try:
        cert.verify_directly_issued_by(ca_cert)
    except (ValueError, TypeError, Exception):  # InvalidSignature is no ValueError
        return "the local CA did not sign it"
    if cert.not_valid_after_utc - _now() < datetime.timedelta(days=RENEW_DAYS):
        return f"it ends on {cert.not_valid_after_utc:%Y-%m-%d}"
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return "it names no host"
    names, addresses = wanted_names(bind_host)
    missing = sorted(names - {n.lower() for n in san.get_values_for_type(x509.DNSName)}) + sorted(
        str(a) for a in addresses - set(san.get_values_for_type(x509.IPAddress)))
    if missing:
        return f"it does not name {', '.join(missing)}"
    return None


def generated(data_dir: Path, bind_host: str) -> ServerTls:
    """The local CA's server certificate for ``bind_host``, made (with the CA, the first
    time) or made again as needed."""
    folder = tls_dir(data_dir)
    with _locked(folder):
        ca_cert, ca_key = _ensure_ca(folder)
        why = _server_is_good(folder, ca_cert, bind_host)
        if why is not None:
            cert, key = _make_server(ca_cert, ca_key, bind_host)
            atomic_write_bytes(folder / SERVER_KEY, _key_pem(key), mode=0o600)
            atomic_write_bytes(folder / SERVER_CERT, _cert_pem(cert), mode=0o644)
            if (folder / SERVER_CERT).exists():
                log.info("made a server certificate for HTTPS (%s)", why if why.startswith("it ") else "new")
    return ServerTls(folder / SERVER_CERT, folder / SERVER_KEY, _cert_pem(ca_cert).decode())


# --- the owner's own pair ---------------------------------------------------------------------

def own(cert_setting: str, key_setting: str) -> ServerTls:
    """The owner's certificate (``tls_cert``: PEM, the server's first, any chain after it)
    and key (``tls_key``: PEM, unencrypted), checked: a LocalmError naming the setting and
    the path for anything that would stop a client from connecting."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    if not cert_setting or not key_setting:
        given, empty = ("tls_cert", "tls_key") if cert_setting else ("tls_key", "tls_cert")
        raise LocalmError(500, f"{given} is set but {empty} is empty: set both (your own certificate and its key), "
                               "or neither (localm's own)", code="tls_invalid")
    paths = {}
    for setting_name, value in (("tls_cert", cert_setting), ("tls_key", key_setting)):
        path = Path(value).expanduser()
        if not path.is_absolute():
            raise LocalmError(500, f"tls_cert and tls_key must be absolute paths: {setting_name} is {value}",
                              code="tls_invalid")
        paths[setting_name] = path.resolve()
    cert_path, key_path = paths["tls_cert"], paths["tls_key"]
    cert_data, key_data = _read_pem(cert_path, "tls_cert"), _read_pem(key_path, "tls_key")
    try:
        chain = x509.load_pem_x509_certificates(cert_data)
    except ValueError:
        raise LocalmError(500, f"tls_cert: {cert_path} is not a PEM certificate", code="tls_invalid") from None
    try:
        key = serialization.load_pem_private_key(key_data, password=None)
    except TypeError:
        raise LocalmError(500, f"tls_key: {key_path} is encrypted; localm needs the key without a passphrase",
                          code="tls_invalid") from None
    except (ValueError, Exception):  # an unsupported key type is no ValueError
        raise LocalmError(500, f"tls_key: {key_path} is not a PEM private key", code="tls_invalid") from None
    leaf = chain[0]
    if _spki(key.public_key()) != _spki(leaf.public_key()):
        raise LocalmError(500, f"tls_key: {key_path} does not match the certificate in tls_cert ({cert_path})",
                          code="tls_invalid")
    if leaf.not_valid_after_utc <= _now():
        log.warning("tls_cert: %s ended on %s: clients will refuse it", cert_path, f"{leaf.not_valid_after_utc:%Y-%m-%d}")
    return ServerTls(cert_path, key_path, _cert_pem(leaf).decode(), own=True)


# --- the start ---------------------------------------------------------------------------------

def for_server(data_dir: Path, setting: Callable[[str], Any], bind_host: str) -> ServerTls | None:
    """What ``localm serve`` serves HTTPS with, read from the settings (``setting(key)``):
    None while ``tls_enabled`` is off. Any problem is a LocalmError, never plain HTTP."""
    if setting("tls_enabled") is not True:
        return None
    try:
        import cryptography  # noqa: F401
    except ImportError:
        raise LocalmError(500, "tls_enabled needs the cryptography package: pip install 'cryptography>=42'",
                          code="tls_invalid") from None
    cert, key = str(setting("tls_cert") or "").strip(), str(setting("tls_key") or "").strip()
    if cert or key:
        return own(cert, key)
    return generated(data_dir, bind_host)


def uvicorn_options(tls: ServerTls | None) -> dict[str, Any]:
    """The keyword arguments uvicorn.Config takes to serve ``tls`` (none for plain HTTP)."""
    if tls is None:
        return {}
    return {"ssl_certfile": str(tls.certfile), "ssl_keyfile": str(tls.keyfile)}
