"""A prepared interpreter for the processes the tests start: torch, Lightning and vitkit imported once, then one
``fork`` per process instead of a fresh interpreter that imports them again. A process that is to import vitkit
from elsewhere (the installed wheel) asks for a server that imported the libraries alone (``preload="libraries"``),
one that is to import huggingface_hub under settings of its own for a server that imported torch alone
(``preload="torch"``).

:func:`popen` takes what ``subprocess.Popen`` takes for ``python ARGS`` (a script, ``-m module`` or ``-c code``)
and returns an object with Popen's ``pid``, ``poll``, ``wait``, ``communicate``, ``send_signal``, ``kill`` and
``returncode``; the timeout of :func:`run` (and of ``tests/tasks/conftest.launch``) raises :class:`Hung`, whose
message shows each process's Python stacks. The child is a fork of the server (one per test process, started on
first use), with the environment, working directory and arguments it was given, and its output captured to files.
Where the environment differs in a variable that is read while those libraries import (``ATEN_CPU_CAPABILITY``,
inductor's settings, thread counts), or a new session or other file handles are asked for, it is a real subprocess
instead.

The server runs no tensor work before forking (no thread pool exists in it to copy), and each child starts from
the same state a fresh interpreter reaches after the imports.
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import os
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
IMPORT_TIME = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONHASHSEED",
               "LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHONSAFEPATH", "PYTHONNOUSERSITE")
TORCH_READS = ("TORCHINDUCTOR_", "TORCH_")


class Preload(NamedTuple):
    modules: tuple[str, ...]  # what the server imports before it forks
    reads: tuple[str, ...]  # the prefixes of the variables those imports read, besides IMPORT_TIME


# "vitkit" for the processes of the source tree; "libraries" (vitkit's dependencies alone) for a process that
# imports vitkit from elsewhere, as the installed wheel's tests do; "torch" alone for a process that must import the
# rest itself (the Hugging Face hub's settings in its environment, which huggingface_hub, imported by Lightning and
# timm, reads when imported; or a check of what importing vitkit imports).
# scikit-learn's digits and split: the digits data modules import them when they set up.
DIGITS = ("sklearn.datasets", "sklearn.model_selection")
PRELOADS = {"vitkit": Preload(("torch", "lightning.pytorch", "timm", *DIGITS, "vitkit", "vitkit.lit",
                               "vitkit.data.modules.streaming"), TORCH_READS + ("HF_", "SKLEARN_")),
            "libraries": Preload(("torch", "lightning.pytorch", "timm", *DIGITS), TORCH_READS + ("HF_", "SKLEARN_")),
            "torch": Preload(("torch",), TORCH_READS)}
DISABLED = os.environ.get("VITKIT_TEST_FORKSERVER", "1") == "0"  # 0: every process a fresh interpreter


def _import_time_env(env: dict, preload: str) -> dict:
    """The variables of ``env`` that the imports of ``PRELOADS[preload]`` read at import."""
    reads = PRELOADS[preload].reads
    return {k: v for k, v in env.items() if k in IMPORT_TIME or k.startswith(reads)}


# -- the server -------------------------------------------------------------------------------------------------

def _child(request: dict, inherited: list[int]) -> None:
    """In the forked child: become ``python ARGS`` with the request's environment, folder and output files."""
    import runpy

    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in inherited:  # the server's socket, pipe and other requests' connections
        try:
            os.close(fd)
        except OSError:
            pass
    if request.get("new_group"):
        os.setpgid(0, 0)
    if sys.path and sys.path[0] == str(Path(__file__).resolve().parent):  # the server's own folder: not a child's
        del sys.path[0]
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(out, fd)
        os.close(out)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    sys.stdout = sys.__stdout__ = os.fdopen(1, "w", buffering=1)
    sys.stderr = sys.__stderr__ = os.fdopen(2, "w", buffering=1)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # dump_stacks(): where a child that hangs stands
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    args = request["args"]
    code = 0
    try:
        if args[0] == "-m":
            sys.modules.pop(args[1], None)  # run as __main__ afresh, as ``python -m`` does
            sys.argv = [args[1], *args[2:]]
            sys.path[:0] = extra + [request["cwd"]]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        elif args[0] == "-c":
            sys.argv = ["-c", *args[2:]]
            sys.path[:0] = extra + [request["cwd"]]
            exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            script = str(Path(request["cwd"], args[0]))
            sys.argv = [script, *args[1:]]
            sys.path[:0] = extra + [str(Path(script).parent)]
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, status 1
        import traceback

        traceback.print_exc()
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def serve(address: str, preload: str) -> None:
    """Import, then fork one child per request; report each child's exit status to the request's connection."""
    import importlib

    for module in PRELOADS[preload].modules:
        importlib.import_module(module)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(address)
    server.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(server, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    waiting: dict[int, socket.socket] = {}
    print("ready", flush=True)
    while True:
        for key, _ in sel.select(timeout=1.0):
            if key.fileobj is server:
                conn, _ = server.accept()
                request = json.loads(conn.makefile().readline())
                if request.get("stop"):
                    return
                pid = os.fork()
                if pid == 0:
                    _child(request, [server.fileno(), wake_r, wake_w, *(c.fileno() for c in waiting.values())])
                conn.sendall(f"{pid}\n".encode())
                waiting[pid] = conn
            else:
                os.read(wake_r, 4096)
        while waiting:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                try:
                    conn.sendall(f"{code}\n".encode())
                except OSError:  # the client stopped waiting (it killed the child and went)
                    pass
                finally:
                    conn.close()
        if os.getppid() == 1:  # the test process that started us is gone
            return


# -- the client -------------------------------------------------------------------------------------------------

class _Server:
    """A server of this test process (one per preload), started on first use and stopped at exit."""

    _lock = threading.Lock()
    _instances: dict[str, _Server] = {}

    def __init__(self, preload: str) -> None:
        self.dir = tempfile.mkdtemp(prefix="vitkit-fork-")
        self.address = os.path.join(self.dir, "socket")
        self.env = dict(os.environ)
        self.proc = subprocess.Popen([sys.executable, __file__, self.address, preload], cwd=ROOT,
                                     stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the test fork server did not start")

    @classmethod
    def get(cls, preload: str) -> _Server:
        with cls._lock:
            server = cls._instances.get(preload)
            if server is None or server.proc.poll() is not None:
                server = cls._instances[preload] = cls(preload)
            return server

    @classmethod
    def env_of(cls, preload: str) -> dict:
        """The environment the server of ``preload`` imported under (this process's own before it starts)."""
        server = cls._instances.get(preload)
        return server.env if server is not None else dict(os.environ)

    def close(self) -> None:
        """Ask the server to return, so that its interpreter exits as usual and runs its exit handlers (the
        temporary folders libraries make at import are removed by them); kill it if it does not."""
        if self.proc.poll() is None:
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                    conn.settimeout(5)
                    conn.connect(self.address)
                    conn.sendall(b'{"stop": true}\n')
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)  # the socket and the children's captured output

    @classmethod
    def stop(cls) -> None:
        for server in cls._instances.values():
            server.close()


atexit.register(_Server.stop)


class ForkedProcess:
    """What ``subprocess.Popen`` gives, for a child of the fork server."""

    def __init__(self, args: list[str], env: dict, cwd: str, text: bool, new_group: bool, preload: str) -> None:
        server = _Server.get(preload)
        self.args, self.text, self.returncode = args, text, None
        fd, self._out = tempfile.mkstemp(dir=server.dir, suffix=".out")
        os.close(fd)
        fd, self._err = tempfile.mkstemp(dir=server.dir, suffix=".err")
        os.close(fd)
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.connect(server.address)
        request = dict(args=args, env=env, cwd=cwd, stdout=self._out, stderr=self._err, new_group=new_group)
        self._conn.sendall((json.dumps(request) + "\n").encode())
        self._buffer = b""
        self.pid = int(self._line(None))

    def _line(self, timeout: float | None) -> str | None:
        """The server's next line; None when ``timeout`` passes first, "" when the server closed without one."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._conn], [], [], left)[0]:
                return None
            chunk = self._conn.recv(4096)
            if not chunk:
                return ""
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def poll(self) -> int | None:
        if self.returncode is None:
            line = self._line(0)
            if line is not None:
                self.returncode = int(line) if line else -signal.SIGKILL
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            line = self._line(timeout)
            if line is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = int(line) if line else -signal.SIGKILL
            self._conn.close()
        return self.returncode

    def _read(self, path: str):
        data = Path(path).read_bytes()
        return data.decode(errors="replace") if self.text else data

    def communicate(self, timeout: float | None = None):
        self.wait(timeout)
        return self._read(self._out), self._read(self._err)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def dump_stacks(self) -> str:
        """The Python stacks of every thread of the child and of the processes it forked (data loader workers),
        which it writes to its stderr on SIGUSR1; the end of its stderr."""
        for pid in [self.pid, *descendants(self.pid)]:
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        time.sleep(1)
        return self._read(self._err)[-8000:]

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def descendants(pid: int) -> list[int]:
    """The processes below ``pid``, from the parent ids in /proc (Linux)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], list(parents.get(pid, []))
    while todo:
        p = todo.pop()
        found.append(p)
        todo += parents.get(p, [])
    return found


class Hung(subprocess.TimeoutExpired):
    """``subprocess.TimeoutExpired`` whose message shows where each process stood (their ``dump_stacks``)."""

    def __init__(self, error: subprocess.TimeoutExpired, procs: list) -> None:
        super().__init__(error.cmd, error.timeout)
        self.stacks = "\n".join(p.dump_stacks() for p in procs if isinstance(p, ForkedProcess))

    def __str__(self) -> str:
        return f"{super().__str__()}; where each process stood:\n{self.stacks}"


def popen(args: list[str], env: dict | None = None, cwd: str | os.PathLike | None = None, text: bool = True,
          new_group: bool = False, preload: str = "vitkit"):
    """``python ARGS`` as a forked child of the prepared interpreter that imported the modules of
    ``PRELOADS[preload]``, or as a fresh interpreter where an import-time setting differs (see the module
    docstring); stdout and stderr are captured."""
    env = dict(os.environ if env is None else env)
    cwd = str(cwd or ROOT)
    if DISABLED or _import_time_env(env, preload) != _import_time_env(_Server.env_of(preload), preload):
        return subprocess.Popen([sys.executable, *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=text, start_new_session=new_group)
    return ForkedProcess(list(args), env, cwd, text, new_group, preload)


def run(args: list[str], env: dict | None = None, cwd: str | os.PathLike | None = None,
        timeout: float | None = None, text: bool = True, preload: str = "vitkit") -> subprocess.CompletedProcess:
    """``subprocess.run([python, *args], capture_output=True)``, through :func:`popen`; on a timeout the process
    is killed and ``subprocess.TimeoutExpired`` raised, as subprocess.run does."""
    proc = popen(args, env, cwd, text, preload=preload)
    try:
        out, err = proc.communicate(timeout)
    except subprocess.TimeoutExpired as e:
        hung = Hung(e, [proc])
        proc.kill()
        proc.wait()
        raise hung from e
    return subprocess.CompletedProcess([sys.executable, *args], proc.returncode, out, err)


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
