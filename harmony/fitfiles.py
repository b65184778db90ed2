"""What runs measured, kept on disk so that a later process on this machine plans with it: the runs' host-cost
figures, whose fits plans take (harmony.calls), and the embedded cluster's calibration (harmony.calibration); one
file of each per device kind and machine in the user's cache directory.

HARMONY_CACHE_DIR names the directory (default $XDG_CACHE_HOME/harmony, else ~/.cache/harmony); set to "", nothing
is read or written. The directory and its files are the user's alone (0700, 0600). A file is replaced whole (written
beside it, then renamed), so a reader never sees half of one; of two processes writing at once, the last one's stays.
A file written by another format, or that cannot be read, counts as empty and is replaced at the next write. What a
file is for is in its name: the device kind, then a digest of what makes fits comparable (this machine's name, its
processor and core count, the versions of torch and Harmony), so that a copied home directory or an upgrade starts
afresh.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import Any

import msgpack
import torch

FORMAT = 5  # the files' layout, their entries' and how their fits were made: a file of another is ignored
WHAT = ("fits", "calibration")  # what a file keeps, the start of its name


def directory() -> Path | None:
    """Where the files are kept, or None where HARMONY_CACHE_DIR is set empty."""
    named = os.environ.get("HARMONY_CACHE_DIR")
    if named is not None:
        return Path(named).expanduser() if named else None
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "harmony"


@functools.cache  # platform.processor() may run `uname -p`
def digest() -> str:
    """What makes fits comparable, digested: the machine's name, processor and cores, torch's and Harmony's versions."""
    what = (FORMAT, platform.node(), platform.machine(), platform.processor(), os.cpu_count(), torch.__version__,
            version("harmony"))
    return hashlib.sha256(repr(what).encode()).hexdigest()[:16]


def path(kind: str, what: str = "fits") -> Path | None:
    """The file of what (WHAT) device kind's runs measured on this machine (None: nothing kept)."""
    assert what in WHAT
    folder = directory()
    return None if folder is None else folder / f"{what}-{kind}-{digest()}.msgpack"


def load(kind: str, what: str = "fits") -> list[dict[str, Any]]:
    """The entries kept for kind, oldest first (none where there is no readable file of this format)."""
    file = path(kind, what)
    if file is None:
        return []
    try:
        content = msgpack.unpackb(file.read_bytes(), raw=False)
    except (OSError, ValueError, msgpack.UnpackException):
        return []
    entries = content.get("entries") if isinstance(content, dict) and content.get("format") == FORMAT else None
    return [entry for entry in entries if isinstance(entry, dict)] if isinstance(entries, list) else []


def save(kind: str, entries: list[dict[str, Any]], what: str = "fits") -> None:
    """Replace kind's file of what with entries (a full disk or a read-only home: nothing kept, the run goes on)."""
    file = path(kind, what)
    if file is None:
        return
    with contextlib.suppress(OSError):
        file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        descriptor, temporary = tempfile.mkstemp(dir=file.parent, prefix=f".{what}-")  # 0600
        try:
            with os.fdopen(descriptor, "wb") as out:
                out.write(msgpack.packb({"format": FORMAT, "entries": entries}, use_bin_type=True))
            os.replace(temporary, file)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise


def remove() -> None:
    """Delete this machine's files, of every device kind and what they keep."""
    folder = directory()
    if folder is not None:
        for file in [file for what in WHAT for file in folder.glob(f"{what}-*-{digest()}.msgpack")]:
            with contextlib.suppress(FileNotFoundError):
                file.unlink()
