"""Files written whole or not at all: readers see the old file or the new one, never half.

The one home of ragkv's atomic writes (index manifests and FAISS files, stored responses,
the KV tree's spilled nodes): a temporary file in the same folder, then `os.replace`.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_bytes(path: Path | str, data: bytes, mode: int = 0o644, durable: bool = True) -> None:
    """Replace `path` with `data`.

    Args:
        mode: the file's permissions (0o600 for what only the server may read).
        durable: fsync the file before the rename and the folder after, so a power loss keeps
            the new file; False for caches whose every read is checked (a torn file is a miss).
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode)  # mkstemp makes 0600
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
