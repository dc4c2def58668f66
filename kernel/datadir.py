"""Where localm keeps what a user owns: ``LOCALM_HOME``, or ``~/.localm`` by default.

```
<data dir>/config.json        settings (only what differs from the defaults)
<data dir>/credentials.json   the settings that are secrets (hf_token, update_token, ...) (0600)
<data dir>/keys.json          scoped API keys, hashed (0600)
<data dir>/owner_key.json     the owner key, hashed (0600)
<data dir>/sessions.json      browser sessions, hashed (0600)
<data dir>/server.json        the running server's address and attach token (0600)
<data dir>/plugins/<name>/    installed plugins
<data dir>/plugin-data/<name>/  each plugin's own data
<data dir>/reports/            bug reports saved for review (0600)
```
"""

from __future__ import annotations

import os
from pathlib import Path


def default_data_dir() -> Path:
    env = os.environ.get("LOCALM_HOME")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".localm"


def server_file(data_dir: Path) -> Path:
    return Path(data_dir) / "server.json"
