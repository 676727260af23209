"""Writes that survive a kill or a power cut at any moment: the reader finds the old complete
file (or directory) or the new complete one, never a truncated mix.

- :func:`atomic_write_text` / :func:`atomic_write_bytes`: write a sibling temporary file, fsync
  it, ``os.replace`` it over the target, fsync the directory (POSIX rename is atomic; the two
  fsyncs make the new content and the new name durable, not only ordered).
- :func:`replace_dir`: the same for a fully written directory. Two renames cannot swap a
  non-empty directory atomically, so the old one is first renamed aside; a kill between the two
  renames leaves ``.<name>.old-*`` and no ``<name>``, which :func:`recover_dir` renames back
  (the old directory was complete). Readers of such directories call :func:`recover_dir` first.

Stdlib only.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from pathlib import Path

__all__ = ["atomic_write_bytes", "atomic_write_text", "fsync_dir", "fsync_tree", "recover_dir",
           "replace_dir"]


def fsync_dir(path: str | Path) -> None:
    """Make the names in directory ``path`` durable (a no-op where directories cannot be
    opened, e.g. Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):  # some filesystems refuse fsync on a directory
            os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | Path) -> None:
    """fsync every regular file under ``root`` and every directory, ``root`` included."""
    root = Path(root)
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            p = os.path.join(dirpath, name)
            if os.path.islink(p):
                continue
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Replace ``path`` with ``data`` atomically and durably (see the module docstring)."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(target.parent)
    return target


def atomic_write_text(path: str | Path, text: str) -> Path:
    """:func:`atomic_write_bytes` of ``text`` encoded as UTF-8."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def replace_dir(tmp: str | Path, target: str | Path) -> None:
    """Move the fully written directory ``tmp`` to ``target``, replacing an old ``target``;
    everything in ``tmp`` is fsynced first. A kill at any point leaves the old or the new
    directory (after :func:`recover_dir`)."""
    tmp, target = Path(tmp), Path(target)
    fsync_tree(tmp)
    if target.exists():
        trash = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(target, trash)
        os.replace(tmp, target)
        fsync_dir(target.parent)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, target)
        fsync_dir(target.parent)


def recover_dir(target: str | Path) -> bool:
    """If ``target`` is missing because a :func:`replace_dir` was killed between its two
    renames, rename the old complete directory back; True when it did. Leftover old copies
    beside a present ``target`` are deleted."""
    target = Path(target)
    olds = sorted(target.parent.glob(f".{target.name}.old-*"),
                  key=lambda p: p.stat().st_mtime) if target.parent.is_dir() else []
    if target.exists():
        for p in olds:
            shutil.rmtree(p, ignore_errors=True)
        return False
    if not olds:
        return False
    os.replace(olds[-1], target)
    fsync_dir(target.parent)
    for p in olds[:-1]:
        shutil.rmtree(p, ignore_errors=True)
    return True
