"""Where ``roseinfer serve`` gets its API key: ``--api-key``, ``--api-key-file`` or the
``ROSEINFER_API_KEY`` environment variable, in that order.

A key given on the command line is visible to every user of the machine (``ps``,
``/proc/<pid>/cmdline``); a file readable only by its owner, or the environment
variable, is not.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

ENV_VAR = "ROSEINFER_API_KEY"
MAX_KEY_FILE_BYTES = 4096


def resolve_api_key(flag: str | None, key_file: str | None,
                    environ: Mapping[str, str]) -> str | None:
    """The key to require, or None for none; ValueError for an unusable source."""
    if flag is not None and key_file is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    if flag is not None:
        return _checked(flag, "--api-key")
    if key_file is not None:
        return _checked(_read_key_file(Path(key_file)), f"--api-key-file {key_file}")
    value = environ.get(ENV_VAR)
    return None if value is None or value == "" else _checked(value, f"${ENV_VAR}")


def _read_key_file(path: Path) -> str:
    try:
        with path.open("rb") as f:
            data = f.read(MAX_KEY_FILE_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"cannot read --api-key-file {path}: {exc.strerror or exc}") from exc
    if len(data) > MAX_KEY_FILE_BYTES:
        raise ValueError(f"--api-key-file {path} is larger than {MAX_KEY_FILE_BYTES} bytes: "
                         "it should hold the key alone")
    try:
        return data.decode("utf-8").strip()  # a trailing newline is not part of the key
    except UnicodeDecodeError as exc:
        raise ValueError(f"--api-key-file {path} is not UTF-8 text") from exc


def _checked(key: str, source: str) -> str:
    key = key.strip()
    if not key:
        raise ValueError(f"the API key from {source} is empty")
    if any(c.isspace() or not c.isprintable() for c in key) or not key.isascii():
        raise ValueError(f"the API key from {source} must be printable ASCII without spaces "
                         "(it travels in an HTTP header)")
    return key
