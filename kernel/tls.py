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
the certificate stops the start with an error naming the setting and the path, never a
fall back to plain HTTP.

Only the standard library is imported here; ``cryptography`` is imported by the functions
that make or read certificates, so a server without TLS never loads it.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import logging
import os
import re
import socket
import ssl
from pathlib import Path
from typing import Any, Iterator

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
CA_DAYS = 3650
#: The most a certificate or key file may hold: checked before it is read.
MAX_PEM_BYTES = 1 << 20
#: Bind addresses that name no one address: the certificate names loopback and this machine.
WILDCARDS = ("0.0.0.0", "::", "")

_PEM_CERT = re.compile(r"-----BEGIN CERTIFICATE-----[A-Za-z0-9+/=\s]+?-----END CERTIFICATE-----")


class TlsError(LocalmError):
    """HTTPS is on but cannot be served as configured: ``localm serve`` stops with this."""

    def __init__(self, detail: str) -> None:
        super().__init__(500, detail, code="tls_invalid")


@attrs.frozen
class Tls:
    """The pair ``localm serve`` serves HTTPS with, and the file a local client trusts."""

    cert: Path
    key: Path
    #: What a client on this machine trusts: localm's CA, or the owner's own certificate
    trust: Path
    #: True for the owner's own pair: a local client trusts exactly that certificate (it may
    #: not name 127.0.0.1), where for localm's own it trusts the CA and checks the name
    own: bool = False

    def uvicorn_options(self) -> dict[str, Any]:
        """The keyword arguments of ``uvicorn.Config`` that serve this pair."""
        return {"ssl_certfile": str(self.cert), "ssl_keyfile": str(self.key)}

    def server_info(self) -> dict[str, Any]:
        """What ``server.json`` records under ``tls`` for the ``localm`` commands."""
        return {"trust": str(self.trust), "own": self.own}


def tls_dir(data_dir: Path) -> Path:
    return Path(data_dir) / TLS_DIR


# --- what a client trusts ----------------------------------------------------------------

def client_context(trust: str | Path, *, own: bool = False) -> ssl.SSLContext:
    """An SSL context for a client of this machine's server: trusting the CA in ``trust``
    (the host name checked), or with ``own``, exactly the first certificate of ``trust``, the
    one the server presents (whoever presents it holds its key; its names are not checked,
    since the owner's certificate may not name 127.0.0.1). OSError or ssl.SSLError when the
    file cannot be used."""
    if not own:
        return ssl.create_default_context(cafile=str(trust))
    with open(trust, "rb") as fh:
        text = fh.read(MAX_PEM_BYTES).decode("ascii", "replace")
    leaf = _PEM_CERT.search(text)
    if leaf is None:
        raise ssl.SSLError(f"{trust} holds no PEM certificate")
    ctx = ssl.create_default_context(cadata=leaf.group(0))
    ctx.check_hostname = False
    ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN  # the server's own certificate is the anchor
    return ctx


# --- names ---------------------------------------------------------------------------------

def wanted_names(bind_host: str) -> tuple[frozenset[str], frozenset[Any]]:
    """(DNS names, IP addresses) the server certificate must name: localhost, the loopback
    addresses, host.docker.internal (a container reaching this machine), this machine's name
    (and NAME.local), and the bind address when it names one address or host."""
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


# --- files ---------------------------------------------------------------------------------

@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """One process at a time makes or checks the files of ``folder`` (0700)."""
    import filelock

    folder.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        os.chmod(folder, 0o700)
    try:
        with filelock.FileLock(str(folder / "tls.lock"), timeout=30):
            yield
    except filelock.Timeout:
        raise TlsError(f"{folder} is locked by another process; try again") from None


def _read(path: Path, what: str) -> bytes:
    """The bytes of ``path``, its size bounded before it is read; TlsError naming ``what``
    (a setting, or the file of localm's own)."""
    try:
        st = path.stat()
        if not path.is_file():
            raise TlsError(f"{what} {path} is not a file")
        if st.st_size > MAX_PEM_BYTES:
            raise TlsError(f"{what} {path} is larger than {MAX_PEM_BYTES} bytes: not a PEM file")
        with open(path, "rb") as fh:
            return fh.read(MAX_PEM_BYTES)
    except FileNotFoundError:
        raise TlsError(f"{what} {path}: no such file") from None
    except OSError as exc:
        raise TlsError(f"{what} {path} cannot be read ({exc.strerror or exc})") from None


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


def _load_key(data: bytes) -> Any:
    """A PEM private key; ValueError when it is none, TypeError when it is encrypted."""
    from cryptography.hazmat.primitives import serialization

    try:
        return serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        raise
    except Exception as exc:  # an unsupported key type
        raise ValueError(str(exc)) from None


# --- localm's own CA and server certificate ------------------------------------------------

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
            .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
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


def _damaged(folder: Path, why: str) -> TlsError:
    return TlsError(f"The localm CA in {folder} is damaged: {why}. Clients trust it, so it is not replaced: restore "
                    f"it, or remove {folder / CA_CERT} and {folder / CA_KEY} to make a new CA (clients must then "
                    "trust the new one)")


def _load_ca(folder: Path) -> tuple[Any, Any] | None:
    """localm's CA (certificate, key), or None when there is none yet. A CA certificate that
    is unreadable, expired or without its key stops here: clients trust it, so it is never
    replaced behind their back."""
    from cryptography import x509

    cert_path, key_path = folder / CA_CERT, folder / CA_KEY
    if not cert_path.exists():
        return None  # a key without its certificate (a first run stopped between the two) is made again
    try:
        cert = x509.load_pem_x509_certificate(_read(cert_path, "the CA certificate"))
    except ValueError:
        raise _damaged(folder, f"{CA_CERT} is not a PEM certificate") from None
    except TlsError as exc:
        raise _damaged(folder, exc.detail) from None
    try:
        key = _load_key(_read(key_path, "the CA key"))
    except (ValueError, TypeError):
        raise _damaged(folder, f"{CA_KEY} is not an unencrypted PEM private key") from None
    except TlsError as exc:
        raise _damaged(folder, exc.detail) from None
    if _spki(key.public_key()) != _spki(cert.public_key()):
        raise _damaged(folder, f"{CA_KEY} is not the key of {CA_CERT}")
    if cert.not_valid_after_utc <= _now() + datetime.timedelta(days=1):
        raise _damaged(folder, f"{CA_CERT} ended on {cert.not_valid_after_utc:%Y-%m-%d}")
    return cert, key


def _ensure_ca(folder: Path) -> tuple[Any, Any]:
    """localm's CA, made now when there is none (the caller holds the folder's lock)."""
    found = _load_ca(folder)
    if found is not None:
        return found
    cert, key = _make_ca()
    atomic_write_bytes(folder / CA_KEY, _key_pem(key), mode=0o600)  # the key first: the CA is whole with its cert
    atomic_write_bytes(folder / CA_CERT, _cert_pem(cert), mode=0o644)
    log.info("made a local CA for HTTPS: %s (clients trust it; GET /localm-ca.crt serves it)", folder / CA_CERT)
    return cert, key


def _renew_reason(folder: Path, ca_cert: Any, bind_host: str) -> str | None:
    """None when the server certificate can be served as it is; else why it is made again."""
    from cryptography import x509

    if not (folder / SERVER_CERT).exists():
        return "there was none"
    try:
        cert = x509.load_pem_x509_certificate(_read(folder / SERVER_CERT, "the server certificate"))
        key = _load_key(_read(folder / SERVER_KEY, "the server key"))
    except TlsError as exc:
        return exc.detail
    except (ValueError, TypeError):
        return "it is not a PEM certificate and key"
    if _spki(key.public_key()) != _spki(cert.public_key()):
        return "its key is not the one beside it"
    try:
        cert.verify_directly_issued_by(ca_cert)
    except Exception:  # a wrong issuer (ValueError) or signature (InvalidSignature)
        return "localm's CA did not sign it"
    if cert.not_valid_after_utc - _now() < datetime.timedelta(days=RENEW_DAYS):
        return f"it ends on {cert.not_valid_after_utc:%Y-%m-%d}"
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return "it names no host"
    names, addresses = wanted_names(bind_host)
    missing = sorted(names - {n.lower() for n in san.get_values_for_type(x509.DNSName)}) + sorted(
        str(a) for a in addresses - set(san.get_values_for_type(x509.IPAddress)))
    return f"it does not name {', '.join(missing)}" if missing else None


def localm_pair(data_dir: Path, bind_host: str) -> Tls:
    """localm's own server certificate for ``bind_host``, signed by its CA: made (with the
    CA, the first time) or made again as needed; TlsError for a damaged CA."""
    folder = tls_dir(data_dir)
    try:
        with _locked(folder):
            ca_cert, ca_key = _ensure_ca(folder)
            why = _renew_reason(folder, ca_cert, bind_host)
            if why is not None:
                cert, key = _make_server(ca_cert, ca_key, bind_host)
                atomic_write_bytes(folder / SERVER_KEY, _key_pem(key), mode=0o600)
                atomic_write_bytes(folder / SERVER_CERT, _cert_pem(cert), mode=0o644)
                log.info("made a server certificate for HTTPS: %s (%s)", folder / SERVER_CERT, why)
    except OSError as exc:  # a data dir that cannot be written: the old files stay as they were
        raise TlsError(f"HTTPS files in {folder} cannot be written ({exc.strerror or exc})") from None
    return Tls(cert=folder / SERVER_CERT, key=folder / SERVER_KEY, trust=folder / CA_CERT, own=False)


def ca_pem(data_dir: Path) -> bytes | None:
    """localm's CA certificate as PEM, None when there is none. It is parsed and written out
    again, so only a certificate ever leaves; a damaged one is a 409."""
    folder = tls_dir(data_dir)
    path = folder / CA_CERT
    if not path.exists():
        return None
    from cryptography import x509

    try:
        return _cert_pem(x509.load_pem_x509_certificate(_read(path, "the CA certificate")))
    except (ValueError, TlsError):
        raise LocalmError(409, f"The localm CA certificate ({CA_CERT}) cannot be read; the owner must fix or remove it",
                          code="unreadable_file") from None


# --- the owner's own pair ---------------------------------------------------------------------

def own_pair(cert_setting: str, key_setting: str) -> Tls:
    """The owner's certificate (``tls_cert``: PEM, the server's first, any chain after it)
    and key (``tls_key``: PEM, unencrypted), checked: TlsError naming the setting and the
    path for anything that would keep a client out."""
    from cryptography import x509

    if not cert_setting or not key_setting:
        given, empty = ("tls_cert", "tls_key") if cert_setting else ("tls_key", "tls_cert")
        raise TlsError(f"{given} is set but {empty} is empty: set both (your own certificate and its key), or "
                       "neither (localm's own)")
    paths: dict[str, Path] = {}
    for name, value in (("tls_cert", cert_setting), ("tls_key", key_setting)):
        path = Path(value).expanduser()
        if not path.is_absolute():
            raise TlsError(f"{name} {value} is not an absolute path")
        paths[name] = path
    cert_path, key_path = paths["tls_cert"], paths["tls_key"]
    cert_data, key_data = _read(cert_path, "tls_cert"), _read(key_path, "tls_key")
    try:
        leaf = x509.load_pem_x509_certificates(cert_data)[0]
    except ValueError:
        raise TlsError(f"tls_cert {cert_path} is not a PEM certificate") from None
    try:
        key = _load_key(key_data)
    except TypeError:
        raise TlsError(f"tls_key {key_path} is encrypted: localm needs the key without a passphrase") from None
    except ValueError:
        raise TlsError(f"tls_key {key_path} is not a PEM private key") from None
    if _spki(key.public_key()) != _spki(leaf.public_key()):
        raise TlsError(f"tls_key {key_path} does not match the certificate in tls_cert {cert_path}")
    if leaf.not_valid_after_utc <= _now():
        log.warning("tls_cert %s ended on %s: clients will refuse it", cert_path,
                    f"{leaf.not_valid_after_utc:%Y-%m-%d}")
    return Tls(cert=cert_path, key=key_path, trust=cert_path, own=True)


# --- the start ---------------------------------------------------------------------------------

def setup_for(data_dir: Path, bind_host: str) -> Tls | None:
    """What ``localm serve`` on ``data_dir`` serves HTTPS with, from its settings: None while
    ``tls_enabled`` is off. Any problem is a TlsError, never plain HTTP instead."""
    from .config import KERNEL_FIELDS, Config

    try:
        raw = Config(Path(data_dir)).raw()
    except LocalmError:
        raise TlsError("config.json cannot be read, so whether HTTPS (tls_enabled) is on is unknown: fix or "
                       "remove it") from None

    def value(key: str) -> Any:
        return raw.get(key, KERNEL_FIELDS[key].default)

    enabled = value("tls_enabled")
    if enabled is not True and enabled is not False:
        raise TlsError(f"tls_enabled in config.json must be true or false, not {str(enabled)[:40]!r}")
    if not enabled:
        return None
    try:
        import cryptography  # noqa: F401
    except ImportError:
        raise TlsError("tls_enabled needs the cryptography package: pip install 'cryptography>=42'") from None
    cert, key = str(value("tls_cert") or "").strip(), str(value("tls_key") or "").strip()
    if cert or key:
        return own_pair(cert, key)
    return localm_pair(Path(data_dir), bind_host)
