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


def private_dir(path: Path | str, what: str) -> Path:
    """`path` as a folder only this user may enter (0700), made when missing (with its parents).

    A folder that is already there with wider modes (a 0755 made before, or by hand) is
    tightened, and that is logged; one this process cannot tighten (another owner) is refused.

    Args:
        what: the flag that names the folder, for the messages (e.g. "--kv-tree-dir").

    Raises:
        ValueError: `path` is not a folder, or its modes cannot be tightened.
    """
    import logging
    import stat

    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{what} {path} is not a directory: give a directory (it is created when missing)")
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        try:
            os.chmod(path, 0o700)
        except OSError as exc:
            raise ValueError(f"{what} {path} has mode {mode:04o}, so other users may read what the server keeps "
                             f"there, and it cannot be made 0700 ({exc}): chmod 700 it, or give another "
                             "directory") from None
        logging.getLogger(__name__).warning("%s %s had mode %04o; made it 0700 (only the server's user may read it)",
                                            what, path, mode)
    return path
