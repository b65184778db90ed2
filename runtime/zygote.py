"""Device workers forked from a process that has imported what they need, instead of each importing it.

A device worker's start is mostly its imports (torch, distributed, torch._dynamo: seconds of a core each time).
The zygote is one process, started from the driver as a worker would be, that imports them once and then forks a
worker whenever the driver's cluster asks: a warm cluster's missing device, a worker that died and starts again,
a cluster started again after a failed run. It lives as long as the driver's process wants it (``close``, at
shutdown), and ends by itself once the driver is gone.

What a reader must keep true to change it:
- A fork copies only the forking thread, so the zygote starts no thread of its own (it waits in select, reaps its
  children on SIGCHLD through a wake-up pipe) and never initializes CUDA (a child that would find CUDA initialized
  could not use it: the zygote refuses, and the driver starts that worker as a fresh process); only CPU devices'
  workers are forked.
- A child becomes what ``python -m distributed.cli.dask_spec`` started with the worker's environment would be: its
  own session, the environment, working directory and sys.path the driver has now, dask's configuration read again
  from them, torch computing with its threads (the zygote's OpenMP read its own environment once); it names the
  zygote as the parent its watchdog follows (runtime.orphans.watch_parent), and ends with os._exit (the handlers
  the zygote registered at exit are not its own).
- The driver is not the workers' parent: the zygote reports each child's end (its exit code as asyncio's
  ``returncode`` has it), and a worker whose zygote died ends by itself (its parent gone), which ``Forked.wait``
  then sees by polling.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, NoReturn

import psutil
import torch

from harmony.runtime.orphans import DRIVER, WATCH_INTERVAL

NAME = b"harmony-device"  # a forked worker's process name (what ps and psutil show; at most 15 bytes)
POLL = 0.1  # how often a worker whose zygote died is looked for, until it has ended
CLOSE_TIMEOUT = 5.0
ENTRY = "from harmony.runtime.zygote import main; main()"  # not -m: importing harmony imports this module first


class Forked:
    """A worker process the zygote forked: what an asyncio.subprocess.Process offers DeviceWorkerProcess (pid,
    returncode, wait, terminate, kill), its end as the zygote reports it."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def ended(self, code: int) -> None:
        """The process has ended with code (a negative signal number where a signal ended it)."""
        with self._lock:
            if self.returncode is not None:
                return
            self.returncode = code
            waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            with contextlib.suppress(RuntimeError):  # its loop closed: nobody waits any more
                loop.call_soon_threadsafe(_resolve, future)

    async def wait(self) -> int:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if self.returncode is None:
                self._waiters.append((loop, future))
            else:
                future.set_result(None)
        await future
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, number: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, number)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class Zygote:
    """The driver's side of a zygote process: fork requests out, their process ids and the children's ends in (a
    thread reads them), over a socket pair the process inherits."""

    def __init__(self, env: dict[str, str]) -> None:
        ours, theirs = socket.socketpair()
        self.socket = ours
        self.process = subprocess.Popen(
            [sys.executable, "-c", ENTRY, str(theirs.fileno())], pass_fds=(theirs.fileno(),),
            env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        theirs.close()
        self._lock = threading.Lock()
        self._requests = 0
        self._replies: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[dict[str, Forked]]]] = {}
        self._children: dict[int, Forked] = {}
        self.alive = True
        self._reader = threading.Thread(target=self._read, name="harmony-zygote", daemon=True)
        self._reader.start()

    async def fork(self, args: list[str], env: dict[str, str], threads: int) -> Forked | None:
        """A worker forked to run ``dask_spec`` with args, env and threads, or None where this zygote cannot (it
        has ended, or refuses: the caller starts the worker as a process of its own)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[dict[str, Forked]] = loop.create_future()
        with self._lock:
            if not self.alive:
                return None
            self._requests += 1
            number = self._requests
            self._replies[number] = (loop, future)
        request = {"id": number, "args": args, "env": env, "threads": threads, "cwd": os.getcwd(),
                   "path": [path for path in sys.path if path]}
        try:
            self.socket.sendall(json.dumps(request).encode() + b"\n")
        except OSError:
            with self._lock:
                self._replies.pop(number, None)
            return None
        reply = await future
        return reply.get("child")

    def _read(self) -> None:
        buffer = b""
        while True:
            try:
                data = self.socket.recv(65536)
            except OSError:
                data = b""
            if not data:
                break
            buffer += data
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                self._handle(json.loads(line))
        self._lost()

    def _handle(self, message: dict[str, Any]) -> None:
        """A child's end, or the answer to a fork request (a child's end always comes after it: the zygote answers
        as it forks, and reaps later)."""
        if "exit" in message:
            with self._lock:
                ended = self._children.pop(message["exit"], None)
            if ended is not None:
                ended.ended(message["code"])
            return
        with self._lock:
            loop, future = self._replies.pop(message["id"])
            reply = {}
            if "pid" in message:
                reply["child"] = self._children[message["pid"]] = Forked(message["pid"])
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_answer, future, reply)

    def _lost(self) -> None:
        """The zygote has ended: no more forks; pending requests are answered with none, and its children, which
        end by themselves now, are watched until they have."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=CLOSE_TIMEOUT)  # reaped: its channel closed as it ended
        with self._lock:
            self.alive = False
            replies, self._replies = self._replies, {}
            children, self._children = list(self._children.values()), {}
        for loop, future in replies.values():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_answer, future, {})
        while children:
            time.sleep(POLL)
            for child in [child for child in children if not psutil.pid_exists(child.pid)]:
                child.ended(-signal.SIGKILL)
                children.remove(child)

    def close(self) -> None:
        """End the zygote (its children are the cluster's to close), waiting up to CLOSE_TIMEOUT for it."""
        with contextlib.suppress(OSError):
            self.socket.shutdown(socket.SHUT_RDWR)
        try:
            self.process.wait(timeout=CLOSE_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.socket.close()


def _answer(future: asyncio.Future[dict[str, Forked]], reply: dict[str, Forked]) -> None:
    if not future.done():
        future.set_result(reply)


def _send(channel: socket.socket, message: dict[str, Any]) -> None:
    channel.sendall(json.dumps(message).encode() + b"\n")


def _reap(channel: socket.socket) -> None:
    """Report every child that has ended."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(channel, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _become_worker(request: dict[str, Any], closing: list[int]) -> NoReturn:
    """In a forked child: run the worker as a fresh ``dask_spec`` process would, then end."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for descriptor in closing:
            os.close(descriptor)
        os.setsid()
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(15, NAME, 0, 0, 0)  # PR_SET_NAME
        os.environ.clear()
        os.environ.update({**request["env"], DRIVER: str(os.getppid())})
        os.chdir(request["cwd"])
        sys.path[:] = [request["cwd"], *request["path"]]
        import dask
        from distributed.cli import dask_spec

        dask.config.refresh()
        torch.set_num_threads(request["threads"])
        dask_spec.main.main(args=request["args"], prog_name="dask-spec")
        code = 0
    except SystemExit as exit:
        code = exit.code if isinstance(exit.code, int) else int(exit.code is not None)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def serve(channel: socket.socket) -> None:
    """The zygote's loop: fork a worker per request, report children's ends, until the driver is gone."""
    wake, woken = os.pipe()
    os.set_blocking(woken, False)
    signal.set_wakeup_fd(woken)
    signal.signal(signal.SIGCHLD, lambda number, frame: None)
    driver = int(os.environ.get(DRIVER, os.getppid()))
    buffer = b""
    while os.getppid() == driver:
        readable, _, _ = select.select([channel, wake], [], [], WATCH_INTERVAL)
        if wake in readable:
            os.read(wake, 4096)
        _reap(channel)
        if channel not in readable:
            continue
        data = channel.recv(65536)
        if not data:
            return
        buffer += data
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            request = json.loads(line)
            if torch.cuda.is_initialized():
                _send(channel, {"id": request["id"], "refused": "CUDA is initialized in the zygote"})
                continue
            try:
                pid = os.fork()
            except OSError as error:
                _send(channel, {"id": request["id"], "refused": str(error)})
                continue
            if pid == 0:
                _become_worker(request, [channel.fileno(), wake, woken])
            _send(channel, {"id": request["id"], "pid": pid})


def main() -> None:
    channel = socket.socket(fileno=int(sys.argv[1]))
    import distributed.cli.dask_spec  # noqa: F401  what a worker imports, once for all of them
    import torch._dynamo  # noqa: F401  what its first optimizer imports (runtime.warmup)

    import harmony.runtime.worker  # noqa: F401  the runtime it runs

    with contextlib.suppress(OSError):  # the driver has gone: its end of the channel closed
        serve(channel)
    sys.stderr.flush()
    os._exit(0)  # nothing of its own to finalize; torch's finalization would take a while
