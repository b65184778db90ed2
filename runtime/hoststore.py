"""The host store: model state in shared-memory files that every process on the machine maps without copies.

What a run keeps there is listed in runtime.files. Files are named ``harmony-<run>-<name>`` under /dev/shm, so
that all of a run's files can be removed at the end whatever happened (and those of a run whose driver died,
see runtime.orphans), and a test can see that none are left. They are readable by the user alone, and their
bytes are allocated when they are created: a /dev/shm too small for them is a HostStoreFull error at that
moment, never a SIGBUS when a page is first touched. A store may be given a byte budget (host_memory). A store
that serves a GPU pins its mappings (cudaHostRegister), so that copies between them and the GPU are
asynchronous and run at the link's speed.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from harmony.tasks.layout import BufferLayout, Slot

PREFIX = "harmony-"
OWNER = "owner"  # the file naming the process that owns a run's files (runtime.orphans)
_CREATING = threading.Lock()  # held while a file is made; freeze takes it for good


def shm_directory() -> Path:
    """Where shared-memory files live: /dev/shm on Linux, the temp directory elsewhere."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(tempfile.gettempdir())


BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def identity(directory: Path | None = None) -> str:
    """This process's machine, as the shared memory it maps tells it: its kernel's boot id and the device of its
    shared-memory directory (see runtime.machines)."""
    try:
        boot = BOOT_ID.read_text().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{boot}/{os.stat(directory or shm_directory()).st_dev}"


def freeze() -> None:
    """From now on no store of this process makes a file (returns once any file being made is made): a process
    about to end removes its runs' files after this, and no file can appear behind that sweep."""
    _CREATING.acquire()


def allocate(descriptor: int, nbytes: int) -> None:
    """Give a file nbytes of allocated space (posix_fallocate where the system has it)."""
    if hasattr(os, "posix_fallocate"):
        os.posix_fallocate(descriptor, 0, nbytes)
    else:
        os.ftruncate(descriptor, nbytes)


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_private(path: Path) -> None:
    """Refuse a file that this run's stores cannot have made: one another user owns, or others may read or write
    (a run's files are its user's alone, 0600). A file a run made has the run's random id in its name, so a stale
    file of a killed run is never taken for this run's."""
    try:
        status = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"host store file {path} is gone: its run has ended") from None
    if status.st_uid != os.getuid() or status.st_mode & 0o077:
        raise PermissionError(f"refusing host store file {path}: owned by uid {status.st_uid} with mode "
                              f"{status.st_mode & 0o777:o}, it is not a file this run made (0600, uid {os.getuid()})")


class HostStoreFull(OSError):
    """A host-store file could not be allocated: the host's shared memory (or the run's host_memory) is full."""


class HostStore:
    """A run's shared-memory files, created by the driver and attached by workers on the same machine.

    budget, when given, is the bytes the files this store creates may take in all (host_memory).
    """

    def __init__(
        self, run: str, directory: Path | str | None = None, pin: bool = False, budget: int | None = None
    ) -> None:
        self.run = run
        self.directory = Path(directory) if directory is not None else shm_directory()
        self.pin = pin
        self.budget = budget
        self.created = 0
        self._mapped: dict[str, torch.Tensor] = {}
        self._pinned: set[str] = set()
        self._closed = False

    def path(self, name: str) -> Path:
        return self.directory / f"{PREFIX}{self.run}-{name}"

    @contextmanager
    def locked(self, name: str) -> Iterator[None]:
        """Hold an exclusive lock on one of the store's files for the block, across the processes of the machine
        (flock: released if the holder dies)."""
        with open(self.path(name), "rb") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _check_open(self, name: str) -> None:
        """Refuse to touch files once closed: a task still running when its run ended (on a user's cluster,
        whose workers outlive the run) must not leave a file behind after the run removed its own."""
        if self._closed:
            raise RuntimeError(f"host store of run {self.run} is closed: {name} is not touched")

    def create(self, name: str, nbytes: int) -> torch.Tensor:
        """A new zero-filled shared buffer of nbytes bytes (uint8), its bytes allocated now and readable by the
        user alone; HostStoreFull when the space (or the store's budget) is not there."""
        self._check_open(name)
        size = max(nbytes, 1)
        if self.budget is not None and self.created + size > self.budget:
            raise HostStoreFull(
                f"the host store needs {self.created + size:,} bytes for {name} but host_memory is {self.budget:,} "
                "bytes; raise host_memory, or train fewer or smaller models at once"
            )
        path = self.path(name)
        self.forget(name)
        with _CREATING:
            self._check_open(name)
            descriptor = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
            try:
                allocate(descriptor, size)
            except OSError as error:
                os.close(descriptor)
                path.unlink(missing_ok=True)
                free = shutil.disk_usage(self.directory).free
                raise HostStoreFull(
                    f"could not allocate {size:,} bytes for {path} ({error.strerror}): {self.directory} has "
                    f"{free:,} bytes free; give the machine more shared memory (in a container, --shm-size), or "
                    "train fewer or smaller models at once"
                ) from None
            os.close(descriptor)
        self.created += size
        return self.attach(name, nbytes)

    def exists(self, name: str) -> bool:
        return name in self._mapped or self.path(name).exists()

    def attach(self, name: str, nbytes: int) -> torch.Tensor:
        """Map an existing buffer; the mapping is shared, so writes are seen by every process.

        A missing file is an error rather than a new file (which torch.from_file would make): a task that
        outlives its run must not leave a file behind after the run removed its own.
        """
        self._check_open(name)
        mapped = self._mapped.get(name)
        if mapped is None:
            with _CREATING:  # torch.from_file would make the file anew, were a sweep to remove it meanwhile
                mapped = self._mapped.get(name)  # mapped meanwhile by another thread (an update beside a task)
                if mapped is None:
                    check_private(self.path(name))
                    mapped = torch.from_file(str(self.path(name)), shared=True, size=max(nbytes, 1),
                                             dtype=torch.uint8)
                    if self.pin:
                        self._register(name, mapped)
                    self._mapped[name] = mapped
        return mapped[:nbytes]

    def _register(self, name: str, mapped: torch.Tensor) -> None:
        """Page-lock a mapping for CUDA (as PyTorch's own host allocator does, a refusal is an error)."""
        cudart = torch.cuda.cudart()
        error = cudart.cudaHostRegister(mapped.data_ptr(), mapped.numel(), 0)
        if error != cudart.cudaError.success:
            raise RuntimeError(
                f"could not pin host store file {self.path(name)} ({mapped.numel():,} bytes) for the GPU: "
                f"{cudart.cudaGetErrorString(error)}; Harmony copies between GPUs and page-locked shared memory"
            )
        self._pinned.add(name)

    def _unregister(self, name: str) -> None:
        if name in self._pinned:
            self._pinned.discard(name)
            torch.cuda.cudart().cudaHostUnregister(self._mapped[name].data_ptr())

    def pinned(self, name: str) -> bool:
        """Whether this process has the file page-locked for the GPU."""
        return name in self._pinned

    def write_bytes(self, name: str, data: bytes) -> None:
        """Replace a small file atomically (metadata that is rewritten rather than mapped)."""
        self._check_open(name)
        path = self.path(name)
        scratch = path.with_name(path.name + ".tmp")
        with _CREATING:
            descriptor = os.open(scratch, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
            with os.fdopen(descriptor, "wb") as handle:
                handle.write(data)
            os.replace(scratch, path)

    def read_bytes(self, name: str) -> bytes | None:
        try:
            return self.path(name).read_bytes()
        except FileNotFoundError:
            return None

    def push(self, names: Iterable[str]) -> None:
        """Make these files where the workers map them: nothing to do for a store the driver maps itself (see
        runtime.machines for one it does not)."""

    def push_all(self) -> None:
        """push every file of the run."""

    def overwrite(self, names: Iterable[str]) -> None:
        """Write these files' bytes into the files the workers map, in place, so that a process that maps one sees
        them (nothing to do for a store the driver maps itself: it wrote them there)."""

    def pull(self, prefixes: tuple[str, ...] = ("",)) -> bool:
        """Bring the files whose names start with one of prefixes from where the workers write them (nothing to
        do for a store the driver maps itself); False when they are out of reach."""
        return True

    def forget(self, name: str) -> None:
        """Drop this process's mapping of one file."""
        self._unregister(name)
        self._mapped.pop(name, None)

    def remove(self, name: str) -> None:
        """Drop this process's mapping of one file and remove the file (processes that map it keep their pages)."""
        self.forget(name)
        self.path(name).unlink(missing_ok=True)

    def close(self) -> None:
        """Drop this process's mappings (the files stay until unlink_all); the store creates nothing after."""
        self._closed = True
        for name in list(self._pinned):
            self._unregister(name)
        self._mapped.clear()

    def unlink_all(self) -> int:
        """Remove every file of this run, its owner record last (runtime.orphans: a removal cut short, as a worker's
        by its process's exit, leaves the record by which a later sweep removes the rest); returns how many were
        removed."""
        self.close()
        removed = 0
        paths = sorted(self.directory.glob(f"{PREFIX}{self.run}-*"), key=lambda path: path == self.path(OWNER))
        for path in paths:
            try:
                os.unlink(path)
                removed += 1
            except FileNotFoundError:
                pass
        return removed


def tensor_at(buffer: torch.Tensor, slot: Slot) -> torch.Tensor:
    """A leaf tensor of slot's dtype and shape sharing buffer's bytes (a uint8 tensor) at slot's offset."""
    dtype = torch_dtype(slot.spec.dtype)
    itemsize = dtype.itemsize
    byte_offset = buffer.storage_offset() + slot.offset
    assert byte_offset % itemsize == 0, "layouts align every tensor"
    return torch.empty(0, dtype=dtype, device=buffer.device).set_(
        buffer.untyped_storage(), byte_offset // itemsize, slot.spec.shape
    )


def tensors_at(buffer: torch.Tensor, layout: BufferLayout) -> dict[str, torch.Tensor]:
    """Every tensor of layout, by name, as views into buffer."""
    return {slot.spec.name: tensor_at(buffer, slot) for slot in layout.slots}
