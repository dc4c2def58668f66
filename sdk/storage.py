"""Files a plugin keeps in the data directory, written so a failure never leaves a half-written
file: ``atomic_write_json`` (a temporary file, fsync, rename), ``read_json`` (a file that
exists but cannot be parsed raises a 409 ``LocalmError`` and is never overwritten), and
``JsonFile`` (one JSON document updated under a cross-process lock: ``file.update(fn)``
applies ``fn`` to the current value and writes the result atomically)."""

from localm.kernel.storage import JsonFile, atomic_write_bytes, atomic_write_json, read_json

__all__ = ["JsonFile", "atomic_write_bytes", "atomic_write_json", "read_json"]
