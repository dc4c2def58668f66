"""``config.json``: the kernel's settings, plugin state and plugin settings.

The file holds only what was changed from the defaults. Reads are cached by the file's
stat; every write is atomic under a cross-process lock; a file that exists but cannot
be parsed is reported (409) and never overwritten.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any, Callable, Mapping

import attrs

from . import limits
from .auth import Principal
from .errors import LocalmError
from .settings import FieldSpec, fields_of, setting
from .storage import JsonFile


@attrs.frozen
class KernelSettings:
    """The kernel's own settings (plugins add theirs under ``plugins.<name>``)."""

    bind_host: str = setting("127.0.0.1", owner_only=True,
                             description="Address `localm serve` binds when --host is not given. "
                                         "Anything but loopback exposes the server: set a key first.")
    port: int = setting(8642, min=1, max=65535,
                        description="Port `localm serve` tries first; the next free one is used when it is busy")
    cors_origins: list[str] = setting(factory=list, owner_only=True,
                                      description="Extra browser origins allowed to call the server "
                                                  "(localhost origins always are)")
    allowed_hosts: list[str] = setting(factory=list, owner_only=True,
                                       description="Extra names this server answers to in the Host header "
                                                   "(addresses, localhost, this machine's name and the bind "
                                                   "address always are; \"*\": any name). A request naming "
                                                   "another host is a 403, so a web page whose own name "
                                                   "resolves to this machine reaches nothing")
    require_auth: bool = setting(False, owner_only=True,
                                 description="Keep requiring a key even after every key is removed (only public "
                                             "routes and the local attach token get through); needs a key to set")
    metrics_enabled: bool = setting(False, owner_only=True,
                                    description="Serve Prometheus metrics at GET /metrics (admin scope; "
                                                "applies at the next start)")
    auto_install_plugin_deps: bool = setting(False, owner_only=True,
                                             description="Install a plugin's pip requirements when it is installed")
    suggest_plugins: bool = setting(True, description="Let clients suggest plugins that would help")
    log_level: str = setting("info", choices=("debug", "info", "warning", "error"),
                             description="Server log level (applies at the next start)")
    log_format: str = setting("text", choices=("text", "json"),
                              description="Server log lines as text, or as one JSON object a line (applies at the "
                                          "next start)")
    max_body_bytes: int = setting(limits.MAX_BODY_BYTES, min=1024, owner_only=True,
                                  description="The largest request body a route accepts unless it sets its own "
                                              "limit (a 413 past it; applies at the next start)")
    max_json_depth: int = setting(limits.MAX_JSON_DEPTH, min=2, max=10000, owner_only=True,
                                  description="How deeply a JSON request body may nest arrays and objects "
                                              "(a 400 past it)")
    expensive_requests_per_minute: int = setting(limits.EXPENSIVE_PER_MINUTE, min=0, owner_only=True,
                                                 description="How many inference requests (generation, embeddings, "
                                                             "reranking, token counts) each key may start a minute "
                                                             "(a 429 with Retry-After past it; 0: no limit)")
    tls_enabled: bool = setting(False, owner_only=True,
                                description="Serve HTTPS instead of HTTP, on the same port (applies at the next "
                                            "start): with tls_cert and tls_key, or with a certificate signed by a "
                                            "local CA localm makes (clients trust GET /localm-ca.crt)")
    tls_cert: str = setting("", owner_only=True,
                            description="Your own certificate to serve HTTPS with: the absolute path of a PEM file "
                                        "(the server's certificate first, its chain after it); empty: localm's own. "
                                        "Needs tls_key (applies at the next start)")
    tls_key: str = setting("", owner_only=True,
                           description="The absolute path of tls_cert's private key (PEM, unencrypted); empty: "
                                       "localm's own (applies at the next start)")
    session_mode: str = setting("metadata", choices=("none", "metadata", "full"), owner_only=True,
                                description="What the session log (session-log.sqlite) keeps of each chat turn: none: "
                                            "nothing; metadata: when, the route, the model, whose key, how it ended "
                                            "and its token counts; full: that, the user's own words and the reply")
    session_log_days: float = setting(30.0, min=0.0, owner_only=True,
                                      description="Days a turn stays in the session log (0: until it is cleared)")
    hf_token: str = setting("", owner_only=True, secret=True,
                            description="Hugging Face access token sent (as a Bearer token) when pulling from the hub, "
                                        "for gated and private repositories; empty: the HF_TOKEN environment "
                                        "variable, if set")
    update_url: str = setting("", owner_only=True,
                              description="The release feed the update routes read ({update_url}/latest.json and "
                                          "the asset it names, from that origin only); empty: no updater")
    update_token: str = setting("", owner_only=True, secret=True,
                                description="Bearer token sent to update_url (over https, or to this machine, only)")
    update_allow_prerelease: bool = setting(False, owner_only=True,
                                            description="Offer and apply prerelease versions")
    update_ignore_net_policy: bool = setting(False, owner_only=True,
                                             description="Let the update check and apply reach update_url even when "
                                                         "net_mode is off")
    net_mode: str = setting("on", choices=("on", "ask", "off"),
                            description="The server's own outbound calls (the bug-report proxy behind GET "
                                        "/api/issues and POST /api/bug-report/send, the update check): on: "
                                        "allowed; ask: only when a request asks for one, never in the "
                                        "background; off: never (those routes answer with an error naming "
                                        "net_mode). Model downloads and upstreams you configure are not affected")
    net_allow_model_downloads: bool = setting(False, owner_only=True,
                                              description="Let model downloads (localm pull from the Hugging Face "
                                                          "hub) through while net_mode is off")
    bugreport_upload_url: str = setting("", owner_only=True,
                                        description="The bug-report proxy (http or https URL) that lists the "
                                                    "project's issues (GET /api/issues) and files reviewed bug "
                                                    "reports (POST /api/bug-report/send); empty: none")
    bugreport_upload_token: str = setting("", owner_only=True, secret=True,
                                          description="Bearer token sent to the bug-report proxy; empty: none")
    keep_diagnostics: int = setting(50, min=1, max=10000, owner_only=True,
                                    description="How many saved bug reports <data dir>/reports keeps (the oldest "
                                                "are removed when a new one is saved)")


KERNEL_FIELDS: dict[str, FieldSpec] = {f.key: f for f in fields_of(KernelSettings)}

#: Plugin *state*, not settings: readable, but changed only by the owner or through their own routes.
STATE_KEYS = {
    "plugins_enabled": "POST /api/plugins/{name}/enable or /disable",
    "plugins": "POST /v1/plugins/{name}/settings",
}

#: Read-only values GET /v1/config adds; PATCH ignores them so a client can send back what it read.
READ_ONLY_EXTRAS = ("effective_mode", "effective_chat_mode", "effective_coder_mode", "effective_ctx_max",
                    "effective_ctx_model", "instance_id", "instance_port")

INSTANCE_ID = secrets.token_hex(8)

#: Settings that name a file: an absolute path, or empty.
ABSOLUTE_PATHS = ("tls_cert", "tls_key")

#: The secret settings (hf_token, update_token, ...): kept in ``credentials.json`` (readable by
#: this user alone) instead of config.json, and written after it, so a change that fails leaves
#: them as they were.
CREDENTIAL_KEYS = tuple(key for key, spec in KERNEL_FIELDS.items() if spec.secret)


class Config:
    def __init__(self, data_dir: Path) -> None:
        self.file = JsonFile(Path(data_dir) / "config.json", what="config.json", default=dict, expect=dict)
        self.credentials = JsonFile(Path(data_dir) / "credentials.json", what="credentials.json", default=dict,
                                    expect=dict, mode=0o600)

    # --- reading ----------------------------------------------------------------
    def raw(self) -> dict[str, Any]:
        return self.file.cached()

    def _credentials(self) -> dict[str, Any]:
        """credentials.json, with any credential an older config.json still holds under it."""
        stored = self.credentials.cached()
        try:
            raw = self.raw()
        except LocalmError:
            raw = {}
        return {**{key: raw[key] for key in CREDENTIAL_KEYS if key in raw}, **stored}

    def get(self, key: str) -> Any:
        """A kernel setting's value (its default when unset or when the file is unreadable)."""
        if key in CREDENTIAL_KEYS:
            try:
                return self._credentials().get(key, KERNEL_FIELDS[key].default)
            except LocalmError:
                return KERNEL_FIELDS[key].default
        try:
            raw = self.raw()
        except LocalmError:
            raw = {}
        if key in raw:
            return raw[key]
        return KERNEL_FIELDS[key].default

    def enabled_overrides(self) -> dict[str, bool]:
        try:
            value = self.raw().get("plugins_enabled", {})
        except LocalmError:
            return {}
        return {k: v for k, v in value.items() if isinstance(v, bool)} if isinstance(value, dict) else {}

    def plugin_block(self, name: str) -> dict[str, Any]:
        try:
            plugins = self.raw().get("plugins", {})
        except LocalmError:
            return {}
        block = plugins.get(name, {}) if isinstance(plugins, dict) else {}
        return block if isinstance(block, dict) else {}

    def view(self, principal: Principal, *, port: int | None,
             plugin_fields: Mapping[str, Mapping[str, FieldSpec]] | None = None) -> dict[str, Any]:
        """The whole config as GET /v1/config shows it to this caller. ``plugin_fields``: each
        plugin's declared settings; a caller who is not the owner sees, in ``plugins``, only the
        values of settings declared there and not owner-only (nor secret)."""
        raw = self.raw()
        if principal.is_owner:
            raw = {**raw, **self._credentials()}
        out: dict[str, Any] = {}
        for key, spec in KERNEL_FIELDS.items():
            if spec.owner_only and not principal.is_owner:
                continue
            out[key] = raw.get(key, spec.default)
        out["plugins_enabled"] = raw.get("plugins_enabled", {})
        plugins = raw.get("plugins", {})
        if not principal.is_owner:
            shown: dict[str, Any] = {}
            for name, block in (plugins.items() if isinstance(plugins, dict) else ()):
                fields = (plugin_fields or {}).get(name, {})
                if isinstance(block, dict):
                    kept = {key: value for key, value in block.items()
                            if key in fields and not fields[key].owner_only}
                    if kept:
                        shown[name] = kept
            plugins = shown
        out["plugins"] = plugins
        out["instance_id"] = INSTANCE_ID
        out["instance_port"] = port
        return out

    # --- writing ----------------------------------------------------------------
    def patch(self, changes: Mapping[str, Any], principal: Principal,
              on_state: Callable[[str, Any], Any] | None = None) -> None:
        """Validate every change, then write them all at once (or nothing)."""
        updates: dict[str, Any] = {}
        for key, value in changes.items():
            if key in READ_ONLY_EXTRAS:
                continue
            if key in STATE_KEYS:
                if not principal.is_owner:
                    raise LocalmError(403, f"{key} is plugin state; use {STATE_KEYS[key]} to change it")
                updates[key] = None if value is None else _check_state(key, value)  # null resets it
                continue
            spec = KERNEL_FIELDS.get(key)
            if spec is None:
                raise LocalmError(400, f"Unknown config key: {key}")
            if spec.owner_only and not principal.is_owner:
                raise LocalmError(403, f"{key} is owner-only: it needs an admin key")
            updates[key] = None if value is None else spec.check(value)
            if key in ABSOLUTE_PATHS and updates[key] and not Path(updates[key]).is_absolute():
                raise LocalmError(400, f"{key} must be an absolute path (the server resolves no other)")
        if not updates:
            self.raw()  # still report an unreadable file
            return
        credentials = {key: updates.pop(key) for key in CREDENTIAL_KEYS if key in updates}
        if credentials:
            self.credentials.read()  # an unreadable file is a 409 before anything is written

        def apply(current: dict[str, Any]) -> dict[str, Any]:
            for key, value in updates.items():
                if value is None:
                    current.pop(key, None)
                else:
                    current[key] = value
            return current
        self.file.update(apply)
        if not credentials:
            return

        def store(current: dict[str, Any]) -> dict[str, Any]:
            for key, value in credentials.items():
                if value is None or value == "":
                    current.pop(key, None)
                else:
                    current[key] = value
            return current
        try:
            self.credentials.update(store)
        except OSError as exc:
            raise LocalmError(500, f"credentials.json could not be written ({exc.strerror or exc}); "
                                   "the credentials are as they were") from None
        if any(key in self.raw() for key in credentials):  # one an older config.json held: moved

            def drop(current: dict[str, Any]) -> dict[str, Any]:
                for key in credentials:
                    current.pop(key, None)
                return current
            self.file.update(drop)

    def set_plugin_enabled(self, name: str, enabled: bool) -> None:
        def apply(current: dict[str, Any]) -> dict[str, Any]:
            state = current.get("plugins_enabled")
            state = dict(state) if isinstance(state, dict) else {}
            state[name] = enabled
            current["plugins_enabled"] = state
            return current
        self.file.update(apply)

    def forget_plugin(self, name: str, *, settings: bool) -> None:
        def apply(current: dict[str, Any]) -> dict[str, Any]:
            for key in ("plugins_enabled", *(("plugins",) if settings else ())):
                block = current.get(key)
                if isinstance(block, dict):
                    block.pop(name, None)
            return current
        self.file.update(apply)

    def set_plugin_values(self, name: str, updates: Mapping[str, Any]) -> None:
        """Merge validated values into ``plugins.<name>``; None clears an override."""
        def apply(current: dict[str, Any]) -> dict[str, Any]:
            plugins = current.get("plugins")
            plugins = dict(plugins) if isinstance(plugins, dict) else {}
            block = plugins.get(name)
            block = dict(block) if isinstance(block, dict) else {}
            for key, value in updates.items():
                if value is None:
                    block.pop(key, None)
                else:
                    block[key] = value
            if block:
                plugins[name] = block
            else:
                plugins.pop(name, None)
            current["plugins"] = plugins
            return current
        self.file.update(apply)


def _check_state(key: str, value: Any) -> Any:
    """A whole plugin-state value as it is stored. A null resets what it stands for: a plugin
    under ``plugins_enabled`` to its manifest's default, a plugin's settings block or one
    setting in it to the defaults (so no null is ever stored)."""
    if key == "plugins_enabled":
        if not isinstance(value, dict) or not all(isinstance(v, bool) or v is None for v in value.values()):
            raise LocalmError(400, "Invalid value for plugins_enabled: expected an object of plugin name → boolean")
        return {name: on for name, on in value.items() if on is not None}
    if not isinstance(value, dict) or not all(isinstance(v, dict) or v is None for v in value.values()):
        raise LocalmError(400, "Invalid value for plugins: expected an object of plugin name → settings object")
    blocks = {name: {k: v for k, v in block.items() if v is not None} for name, block in value.items() if block}
    return {name: block for name, block in blocks.items() if block}
