"""A warm start for worker processes: a server that has imported what every worker imports
before its engine (``PRELOAD``: psycopg, pydantic, the spec, the worker's modules) forks
each new worker, so a worker starts without paying those imports (about 0.4 CPU-s each).

``ForkServer.start(env)`` runs ``python -m gpu_runner.forkserver`` with ``env``;
``ForkServer.spawn`` asks it for one process of ``python -m MODULE ARGS`` or
``python -c CODE ARGS`` and returns a ``ForkedProcess``, which answers what
``batch_inference.fleet`` asks of a ``subprocess.Popen``: ``pid``, ``stdout``
(the process's stdout and stderr, one pipe), ``poll``, ``wait``, ``returncode``
(negative: the signal that ended it), ``send_signal``/``terminate``/``kill``.

What a forked worker gets is what ``subprocess.Popen`` gives it: its own environment
(``os.environ`` and the C environment replaced before its code runs), its argv, the
caller's working directory at the spawn, a session of its own when asked, default
SIGINT/SIGTERM/SIGCHLD handling, and a normal interpreter exit (atexit, non-daemon
threads, the exit code of ``sys.exit``; a signal's death reaches the caller as
``-signal``). What the server fixed at its own start is what the interpreter and the
preloaded modules read from the environment then: the ``PYTHON*``, locale, ``TZ``,
``HOME``, ``LD_*`` and ``OPENSSL_*`` variables, and every variable the preload read
(the server records them: ``ForkServer.fixed``). ``ForkServer.fits`` says whether a
worker's environment agrees on all of them; one that does not needs a server of its own.

No engine (llama.cpp, vLLM, torch) is imported in the server, and the server starts
no thread: a fork after OpenMP's or torch's threads have started is unsafe. The
server refuses to serve (and its caller starts workers with ``subprocess.Popen``)
if the preload did either. Nothing here but ``serve`` imports the worker.

The server reaps its children and sends each exit to the caller on that child's own
socket; it exits when its caller closes the control socket (or dies), leaving running
children to run on as ``Popen``'s would.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# What every worker imports before its engine (``python -m gpu_runner`` imports gpu_runner.worker first).
PRELOAD = ("gpu_runner.worker",)
# Modules the server must not hold: an engine's threads (OpenMP, torch) do not survive a fork.
NEVER_PRELOADED = ("torch", "vllm", "llama_cpp", "airflow")
# Variables the interpreter (and OpenSSL, loaded with psycopg) reads before or while the preload runs.
FIXED_PREFIXES = ("PYTHON", "LC_", "LD_", "OPENSSL_")
FIXED_NAMES = frozenset({"LANG", "LANGUAGE", "TZ", "HOME"})
READY_TIMEOUT_S = 60.0
# ``ForkedProcess.returncode`` when the server went away before it could say how a child ended (the
# child is then watched by its pid until it is gone).
LOST = 255
_MSG = 1 << 16


class ForkServerError(RuntimeError):
    """The fork server could not start, or could not start a process."""


# -- the caller's side ---------------------------------------------------------

class ForkedProcess:
    """A process the fork server started: the part of ``subprocess.Popen`` the fleet uses."""

    def __init__(self, args: list[str], pid: int, status: socket.socket, stdout: Any):
        self.args = args
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None
        self.cpu_s: float | None = None    # user + system CPU seconds it spent (and its children it waited for)
        self._status = status
        self._orphan = False               # the server went away while it ran: watched by its pid
        self._lock = threading.Lock()

    def _collect(self) -> None:
        """Read the exit status if the server sent it (never blocks)."""
        with self._lock:
            if self.returncode is not None:
                return
            if not self._orphan:
                try:
                    msg = self._status.recv(_MSG, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    return
                except OSError:
                    msg = b""
                self._status.close()
                if msg:
                    ended = json.loads(msg)
                    self.returncode, self.cpu_s = ended["exit"], ended.get("cpu_s")
                    return
                self._orphan = True
            if not _running(self.pid):
                self.returncode = LOST

    def poll(self) -> int | None:
        self._collect()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            if self._orphan:
                time.sleep(0.05 if left is None else min(left, 0.05))
                continue
            with contextlib.suppress(OSError, ValueError):     # closed meanwhile by another thread's poll
                select.select([self._status], [], [], left)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _stdin() -> list[int]:
    """This process's fd 0 while it has one."""
    try:
        os.fstat(0)
    except OSError:
        return []
    return [0]


def _running(pid: int) -> bool:
    """``pid`` exists and is not a zombie (an orphan's zombie waits for whoever reaps orphans here)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def fixed_names(env: Mapping[str, str]) -> set[str]:
    """The variables of ``env`` that the interpreter reads at its start."""
    return {k for k in env if k in FIXED_NAMES or k.startswith(FIXED_PREFIXES)}


class ForkServer:
    """One running fork server (``start``), and the processes it forks (``spawn``)."""

    def __init__(self, proc: subprocess.Popen[str], control: socket.socket, env: Mapping[str, str],
                 read: Sequence[str], on_output: Callable[[str], None] | None):
        self.proc = proc
        self.pid = proc.pid
        self._control = control
        self._lock = threading.Lock()
        self.env = dict(env)
        self.cwd = os.getcwd()
        self.fixed = frozenset(fixed_names(env) | set(read))
        self.spawned = 0
        self._children: list[ForkedProcess] = []
        self._output = threading.Thread(target=self._drain, args=(on_output,), daemon=True,
                                        name=f"bi-forkserver-{proc.pid}")
        self._output.start()

    @classmethod
    def start(cls, env: Mapping[str, str], on_output: Callable[[str], None] | None = None,
              timeout: float = READY_TIMEOUT_S) -> ForkServer:
        """Start a server with ``env`` and wait until it has imported ``PRELOAD``; ForkServerError
        (with the server's own last lines) when it did not."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            proc = subprocess.Popen([sys.executable, "-m", "gpu_runner.forkserver", str(theirs.fileno())],
                                    env=dict(env), pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, errors="replace")
        except OSError as exc:
            mine.close()
            raise ForkServerError(f"could not run the fork server: {exc}") from exc
        finally:
            theirs.close()
        ready, _, _ = select.select([mine], [], [], timeout)
        msg = mine.recv(_MSG) if ready else b""
        if not msg:
            mine.close()
            proc.kill()
            out = proc.communicate()[0].strip().splitlines()
            raise ForkServerError("the fork server did not start" + (f": {out[-1]}" if out else
                                                                        f" in {timeout:g} s"))
        return cls(proc, mine, env, json.loads(msg)["read"], on_output)

    def _drain(self, on_output: Callable[[str], None] | None) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if on_output is not None:
                on_output(line.rstrip("\n"))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def fits(self, env: Mapping[str, str]) -> bool:
        """True when a process with ``env`` would start here as it would from its own interpreter (a
        relative PYTHONPATH entry also needs the working directory the server started in)."""
        if any(not os.path.isabs(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p) \
                and os.getcwd() != self.cwd:
            return False
        return all(env.get(k) == self.env.get(k) for k in self.fixed | fixed_names(env))

    def spawn(self, command: Sequence[str], env: Mapping[str, str], new_session: bool = False) -> ForkedProcess:
        """Fork ``command`` (``[sys.executable, "-m", MODULE, ...]`` or ``[sys.executable, "-c", CODE, ...]``)
        with ``env``, its stdout and stderr on one pipe, in the caller's working directory."""
        if len(command) < 2 or command[0] != sys.executable or command[1] not in ("-m", "-c"):
            raise ForkServerError(f"not a command the fork server runs: {list(command)[:3]}")
        r, w = os.pipe()
        status, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        request = json.dumps({"argv": list(command[1:]), "env": dict(env), "cwd": os.getcwd(),
                              "new_session": new_session}).encode()
        try:
            with self._lock:
                # the caller's stdin, as Popen's child inherits it (none when it has none)
                socket.send_fds(self._control, [request], [w, theirs.fileno(), *_stdin()])
            ready, _, _ = select.select([status], [], [], READY_TIMEOUT_S)
            msg = status.recv(_MSG) if ready else b""
        except OSError as exc:
            msg, error = b"", exc
        else:
            error = None
        finally:
            os.close(w)
            theirs.close()
        if not msg:
            os.close(r)
            status.close()
            raise ForkServerError(f"the fork server (pid {self.pid}) did not start the process"
                                  + (f": {error}" if error else ""))
        self.spawned += 1
        stdout = open(r, "r", buffering=1, errors="replace")   # noqa: SIM115 - the fleet's reader owns it
        child = ForkedProcess(list(command), json.loads(msg)["pid"], status, stdout)
        self._children = [c for c in self._children if c.poll() is None] + [child]
        return child

    def idle(self) -> bool:
        """No process it forked is still running."""
        return all(c.poll() is not None for c in self._children)

    def close(self, timeout: float = 10.0) -> None:
        """Ask the server to exit (its running children run on) and collect it."""
        with contextlib.suppress(OSError):
            self._control.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._output.join(timeout=2)


# The servers this process started, one per environment that fits (``ForkServer.fits``), each kept
# for later fleets until the process exits; at most MAX_SERVERS (an idle one gives way to a new one).
MAX_SERVERS = 3
_servers: list[ForkServer] = []
_servers_lock = threading.Lock()
_closing_at_exit: list[bool] = []


def server_for(env: Mapping[str, str], on_output: Callable[[str], None] | None = None) -> tuple[ForkServer, bool]:
    """A running server that ``fits`` ``env``, started with ``env`` when none does; and whether it
    was started now. ForkServerError when none can start."""
    with _servers_lock:
        _servers[:] = [s for s in _servers if s.alive()]
        for s in _servers:
            if s.fits(env):
                return s, False
        if len(_servers) >= MAX_SERVERS:
            idle = next((s for s in _servers if s.idle()), None)
            if idle is None:
                raise ForkServerError(f"{MAX_SERVERS} fork servers are busy with other environments")
            _servers.remove(idle)
            idle.close()
        s = ForkServer.start(env, on_output)
        if not _closing_at_exit:
            atexit.register(close_all)
            _closing_at_exit.append(True)
        _servers.append(s)
        return s, True


def _forget_servers() -> None:
    """In a child forked from a process with servers: they are its parent's (the child starts its own)."""
    global _servers_lock
    _servers_lock = threading.Lock()
    for s in _servers:
        with contextlib.suppress(OSError):
            s._control.close()
    _servers.clear()


os.register_at_fork(after_in_child=_forget_servers)


def close_all() -> None:
    """Close every server this process started (at exit: each is collected, so its children's CPU
    time counts in this process's)."""
    with _servers_lock:
        for s in _servers:
            s.close()
        _servers.clear()


# -- the server's side ---------------------------------------------------------

@dataclass
class _Child:
    """What a forked child runs once the server's frames are gone (``run``)."""

    argv: list[str]

    def run(self) -> None:
        gc.disable()    # as ``python -m gpu_runner`` runs its imports; the worker turns it on for its engine
        if self.argv[0] == "-m":
            import runpy
            sys.path[0] = os.getcwd()          # as ``python -m`` puts it
            sys.argv = [self.argv[1], *self.argv[2:]]
            runpy.run_module(self.argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = ""                   # as ``python -c`` puts it
            sys.argv = ["-c", *self.argv[2:]]
            exec(compile(self.argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})


def _preload() -> list[str]:
    """Import ``PRELOAD`` and return the environment variables it read ('*' when it read them all)."""
    read: set[str] = set()
    cls = type(os.environ)
    saved = cls.__getitem__, cls.__contains__, cls.__iter__

    def getitem(self: Any, key: str) -> str:
        read.add(key)
        return saved[0](self, key)

    def contains(self: Any, key: object) -> bool:
        read.add(str(key))
        return saved[1](self, key)

    def iterate(self: Any) -> Any:
        read.add("*")
        return saved[2](self)

    cls.__getitem__, cls.__contains__, cls.__iter__ = getitem, contains, iterate   # type: ignore[method-assign]
    try:
        for name in PRELOAD:
            importlib.import_module(name)
    finally:
        cls.__getitem__, cls.__contains__, cls.__iter__ = saved      # type: ignore[method-assign]
    return sorted(read)


def serve(control_fd: int) -> _Child | None:
    """The server's loop. Returns in a forked child (with what it is to run), or None when the
    caller closed the control socket."""
    gc.disable()
    read = _preload()
    engines = [m for m in NEVER_PRELOADED if m in sys.modules]
    if engines or threading.active_count() != 1 or "*" in read:
        why = (f"imported {', '.join(engines)}" if engines else "read the whole environment" if "*" in read
               else f"started {threading.active_count() - 1} thread(s)")
        print(f"gpu_runner.forkserver: the preload {why}; a fork of it is unsafe", file=sys.stderr)
        sys.exit(1)
    gc.freeze()      # what the imports made stays untouched by each child's collections: its pages stay shared
    control = socket.socket(fileno=control_fd)
    control.sendall(json.dumps({"read": read, "pid": os.getpid()}).encode())
    signal.signal(signal.SIGINT, signal.SIG_IGN)      # a Ctrl-C or a group's SIGTERM is for the workers
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, socket.socket] = {}

    def reap() -> None:
        while children:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            sock = children.pop(pid, None)
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status),
                                             "cpu_s": usage.ru_utime + usage.ru_stime}).encode())
                sock.close()

    while True:
        try:
            ready, _, _ = select.select([control, wake_r], [], [])
        except InterruptedError:
            continue
        if wake_r in ready:
            os.read(wake_r, 4096)
            reap()
        if control not in ready:
            continue
        msg, fds, _, _ = socket.recv_fds(control, _MSG, 3)
        if not msg:
            reap()
            return None       # the caller is gone or closed it: exit; running children run on
        out_fd, status_fd, *stdin_fd = fds
        request = json.loads(msg)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            # The child: nothing of the server's stays open or installed.
            signal.set_wakeup_fd(-1)
            for sig, handler in ((signal.SIGCHLD, signal.SIG_DFL), (signal.SIGTERM, signal.SIG_DFL),
                                 (signal.SIGINT, signal.default_int_handler)):
                signal.signal(sig, handler)
            for sock in (control, *children.values()):
                sock.close()
            os.close(wake_r)
            os.close(wake_w)
            os.close(status_fd)
            if request["new_session"]:
                os.setsid()
            os.dup2(out_fd, 1)
            os.dup2(out_fd, 2)
            os.close(out_fd)
            if stdin_fd:
                os.dup2(stdin_fd[0], 0)
                os.close(stdin_fd[0])
            else:
                os.close(0)
                sys.stdin = None    # type: ignore[assignment]  # as in an interpreter started without one
            os.chdir(request["cwd"])
            os.environ.clear()
            os.environ.update(request["env"])
            return _Child(request["argv"])
        for fd in (out_fd, *stdin_fd):
            os.close(fd)
        sock = socket.socket(fileno=status_fd)
        children[pid] = sock
        with contextlib.suppress(OSError):
            sock.sendall(json.dumps({"pid": pid}).encode())


if __name__ == "__main__":
    child = serve(int(sys.argv[1]))
    if child is None:
        sys.exit(0)
    del serve
    child.run()
