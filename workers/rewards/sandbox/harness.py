"""The in-sandbox harness: runs one program, or one set of tests, and reports what it saw.

This file is executed by the sandbox's own interpreter (standard library only, ``python -I -S -B``); the worker
also imports it for ``encode``/``decode``, the one definition of the value format both sides speak.

Two ways in:

* local: ``python -c <this source> serve FD`` in a pre-started sandbox (or the same, compiled beforehand and loaded
  by ``isolation.LOAD_HARNESS``). It announces ``{"ev": "ready"}`` on the
  channel FD, then reads one job from stdin as ``<length>\\n<json>``; what follows on stdin is the program's stdin
  (``stdio``) or, in the two halves of a checked run, the protocol lines below. Events go to FD, one JSON object
  per line.
* remote: this source followed by ``run_job(<job>, <marker>)``, sent as one script; events go to stderr, each line
  prefixed with a random marker so the worker can find them among the program's own stderr.

Job modes:

* ``stdio`` runs the program as ``__main__`` and reports how it ended (stdout goes straight to the worker);
* ``stdio_tests`` (reused sandboxes only) compiles the program once and runs it once per test, each in a child
  forked for it with that test's stdin, and reports each test as the worker would have seen a ``stdio`` run of
  its own (``_run_stdio_tests``);
* ``call`` calls ``fn_name`` (or ``Solution().fn_name``) with each argument list and reports each return value.
  Everything reported is a *claim* the worker judges outside: expected outputs never reach the program.
* ``serve`` and ``check`` are the two halves of a checked run (assert-style and ``check(candidate)`` tests), each
  in its own sandbox. ``serve`` loads the program and answers requests (look a name up, call a function, read an
  attribute) with plain data, or with a handle when the value is not plain data. ``check`` runs the dataset's
  test code, where every name the test does not define is a request to the program, and reports each test's
  verdict. The worker relays the lines between them. Only plain data crosses, so nothing the program made (an
  object whose ``__eq__`` always answers True, a patched builtin, a forged report) can reach the code that
  compares, and the expected values never enter the program's interpreter.
"""

import builtins
import os
import resource
import sys

_MAX_DEPTH = 100
_channel_fd = 2
_marker = b""

# JSON through CPython's C accelerator: importing the ``json`` package (with ``re``, ``enum``, ...) would double the
# interpreter's start-up, which every sandbox pays. Another interpreter gets the package.
try:
    import _json
except ImportError:
    import json as _full_json

    def _dumps(value):
        return _full_json.dumps(value, separators=(",", ":"))

    def _loads(text):
        return _full_json.loads(text)

else:

    class _Context:
        strict = True
        object_hook = None
        object_pairs_hook = None
        parse_float = float
        parse_int = int
        memo = {}

        @staticmethod
        def parse_constant(name):
            return {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}[name]

    def _refuse(value):
        raise TypeError(f"cannot write a value of type {type(value).__name__} as JSON")

    _scan = _json.make_scanner(_Context)
    _encode = _json.make_encoder(
        None, _refuse, _json.encode_basestring_ascii, None, ":", ",", False, False, True
    )

    def _dumps(value):
        return "".join(_encode(value, 0))

    def _loads(text):
        if type(text) is not str:
            text = bytes(text).decode("utf-8")
        try:
            value, end = _scan(text, 0)
        except StopIteration:
            raise ValueError("not JSON") from None
        if text[end:].strip():
            raise ValueError("extra data after the JSON value")
        return value


def _emit(event):
    data = _marker + _dumps(event).encode() + b"\n"
    while data:
        data = data[os.write(_channel_fd, data) :]


def _limit(kind, value):
    _, hard = resource.getrlimit(kind)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(kind, (value, value))


def _apply_limits(limits):
    # The soft CPU limit is the wall limit plus a margin: the worker's wall clock normally ends the run first.
    _limit(resource.RLIMIT_CPU, int(limits["cpu_s"]))
    _limit(resource.RLIMIT_AS, int(limits["memory_bytes"]))
    _limit(resource.RLIMIT_FSIZE, int(limits["file_bytes"]))
    _limit(resource.RLIMIT_NOFILE, int(limits["open_files"]))
    _limit(resource.RLIMIT_NPROC, int(limits["processes"]))
    _limit(resource.RLIMIT_CORE, 0)


# ---- the value format: tagged JSON of plain built-in data ----


def encode(value, depth=0, handle_id=None):
    """Tagged JSON of plain data; anything else (a subclass, an object with its own ``__eq__``) raises
    ``TypeError``. ``handle_id`` maps an object to its handle number (or ``None``), for the checker's arguments."""
    kind = type(value)
    if kind is int and value.bit_length() > 63:
        # Hex, because decimal conversion of very long ints is capped (and slow) in both interpreters.
        return {"__t": "int", "v": format(value, "x")}
    if value is None or kind is bool or kind is int or kind is float or kind is str:
        return value
    if depth > _MAX_DEPTH:
        raise ValueError("value nested too deeply")
    if kind is list:
        return [encode(v, depth + 1, handle_id) for v in value]
    if kind is tuple or kind is set or kind is frozenset:
        return {"__t": kind.__name__, "v": [encode(v, depth + 1, handle_id) for v in value]}
    if kind is dict:
        return {
            "__t": "dict",
            "v": [
                [encode(k, depth + 1, handle_id), encode(v, depth + 1, handle_id)] for k, v in value.items()
            ],
        }
    if kind is bytes:
        return {"__t": "bytes", "v": value.hex()}
    number = handle_id(value) if handle_id is not None else None
    if number is not None:
        return {"__t": "handle", "v": number}
    raise TypeError(f"cannot send a value of type {kind.__name__}")


def decode(value, depth=0, handles=None):
    """Rebuild a value from its tagged JSON; ``ValueError`` on anything malformed. ``handles`` (a list) resolves
    handle tags, on the program's side only."""
    if depth > 2 * _MAX_DEPTH + 2:
        raise ValueError("value nested too deeply")
    if value is None or type(value) in (bool, int, float, str):
        return value
    if type(value) is list:
        return [decode(v, depth + 1, handles) for v in value]
    if type(value) is not dict or set(value) != {"__t", "v"}:
        raise ValueError("malformed value")
    tag, items = value["__t"], value["v"]
    if tag == "bytes" and type(items) is str:
        return bytes.fromhex(items)
    if tag == "int" and type(items) is str:
        return int(items, 16)
    if tag == "handle" and handles is not None and type(items) is int and 0 <= items < len(handles):
        return handles[items]
    if type(items) is not list:
        raise ValueError("malformed value")
    if tag == "tuple":
        return tuple(decode(v, depth + 1, handles) for v in items)
    if tag == "set":
        return {decode(v, depth + 1, handles) for v in items}
    if tag == "frozenset":
        return frozenset(decode(v, depth + 1, handles) for v in items)
    if tag == "dict":
        if not all(type(kv) is list and len(kv) == 2 for kv in items):
            raise ValueError("malformed dict")
        return {decode(k, depth + 1, handles): decode(v, depth + 1, handles) for k, v in items}
    raise ValueError(f"unknown tag {tag!r}")


def _error_name(err):
    return type(err).__name__


def _finish():
    for stream in (sys.stdout, sys.stderr):
        try:  # noqa: SIM105 - contextlib is not imported in here: its import would slow every start
            stream.flush()
        except BaseException:
            pass
    _emit({"ev": "done"})
    os._exit(0)


class _Quitter:
    """``exit()`` and ``quit()`` as the ``site`` module defines them (the interpreter runs without ``site``)."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"Use {self.name}() or Ctrl-D (i.e. EOF) to exit"

    def __call__(self, code=None):
        try:  # noqa: SIM105 - as in _finish
            sys.stdin.close()
        except BaseException:
            pass
        raise SystemExit(code)


def _program_namespace(name):
    return {"__name__": name, "__builtins__": builtins}


def _run_stdio(code):
    sys.argv = ["solution.py"]
    namespace = _program_namespace("__main__")
    error = None
    try:
        exec(code, namespace)
    except SystemExit as err:
        if not (err.code is None or (type(err.code) is int and err.code == 0)):
            error = "SystemExit"
    except BaseException as err:
        error = _error_name(err)
    try:
        sys.stdout.flush()
    except BaseException as err:
        error = error or _error_name(err)
    _emit({"ev": "exit", "ok": error is None, "error": error})


def _solution_namespace(code):
    namespace = _program_namespace("__solution__")
    try:
        exec(code, namespace)
    except BaseException as err:
        _emit({"ev": "module_error", "error": _error_name(err)})
        return None
    return namespace


def _report(test, thunk):
    try:
        value = thunk()
    except BaseException as err:
        return {"t": test, "e": _error_name(err)}
    try:
        return {"t": test, "v": encode(value)}
    except BaseException:
        return {"t": test, "e": "Unreportable"}


def _run_call(code, fn_name, calls):
    namespace = _solution_namespace(code)
    if namespace is None:
        return
    fn = namespace.get(fn_name)
    if not callable(fn) and isinstance(namespace.get("Solution"), type):
        try:
            fn = getattr(namespace["Solution"](), fn_name, None)
        except BaseException as err:
            _emit({"ev": "module_error", "error": _error_name(err)})
            return
    if not callable(fn):
        _emit({"ev": "module_error", "error": "NameError"})
        return
    for test, args_json in enumerate(calls):
        args = _loads(args_json)
        event = _report(test, lambda args=args: fn(*args))
        try:
            _emit(event)
        except ValueError:
            _emit({"t": test, "e": "Unreportable"})


# ---- checked runs: the line protocol ----


class _Lines:
    """Lines read from a file descriptor, one JSON object each."""

    def __init__(self, fd):
        self.fd = fd
        self.buffer = b""

    def next(self):
        while b"\n" not in self.buffer:
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return _loads(line)


def _private_stdin():
    """The job's stdin, moved out of the program's way: fd 0 becomes /dev/null."""
    saved = os.dup(0)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    return _Lines(saved)


def _answer(request, namespace, handles):
    """The program's side of one request: plain data (``v``), a handle (``h``) or the exception's name (``e``)."""
    op = request.get("op")
    args = None
    try:
        if op == "get":
            value = namespace[request["name"]]
        elif op == "attr":
            value = getattr(handles[request["h"]], request["name"])
        elif op == "list":
            value = list(handles[request["h"]])
        else:
            args = [decode(a, 0, handles) for a in request["args"]]
            kwargs = {k: decode(v, 0, handles) for k, v in request["kw"]}
            value = handles[request["h"]](*args, **kwargs)
    except KeyError as err:
        return {"e": "NameError" if op == "get" else _error_name(err)}
    except BaseException as err:
        return {"e": _error_name(err)}
    answer = {}
    if args is not None:
        # Arguments the call changed in place go back, so that a test can check them.
        after = []
        for i, sent in enumerate(request["args"]):
            try:
                now = encode(args[i])
            except BaseException:
                now = sent
            after.append(now)
        if after != request["args"]:
            answer["a"] = after
    try:
        answer["v"] = encode(value)
    except TypeError:
        handles.append(value)
        answer["h"] = len(handles) - 1
    except BaseException:
        answer["e"] = "Unreportable"
    return answer


def _run_serve(code, requests):
    """Load the program, then answer the checker's requests until they end."""
    namespace = _solution_namespace(code)
    if namespace is None:
        return
    _emit({"ev": "loaded"})
    handles = []
    while True:
        try:
            request = requests.next()
        except ValueError:
            return
        if type(request) is not dict:
            return
        answer = _answer(request, namespace, handles)
        answer["id"] = request.get("id")
        try:
            _emit(answer)
        except ValueError:
            _emit({"id": request.get("id"), "e": "Unreportable"})


#: Bytes of a test's stderr forwarded to the worker (for debugging; the rest is counted, not kept).
_STDERR_HEAD = 4096


def _run_stdio_tests(code, job):
    """Run the compiled program once per test, each in a child forked for it (so its interpreter, modules and
    compiled code are this process's, copy-on-write), and report each test to the worker as a ``stdio`` run of
    its own would have looked: per test, its stdout, channel and the head of its stderr go to stdout, one after
    the other, and an event ``{"ev": "test", "i", "status", "code", "out", "ch", "err"}`` gives their lengths.

    This process (the run's, forked by the zygote) is the tests' parent and is kept out of their reach: it is not
    dumpable (no ``/proc/<pid>/mem`` or ``fd`` for a test), a test's descriptors are only its own 0-3, and it is a
    child subreaper, so whatever a test leaves running is killed and reaped before the next test starts, and the
    writable directories are emptied. A test may still kill or stop it (same user): the tests not yet reported
    then fail, which is the program's doing. Stops after a test that timed out, as the worker does."""
    if _libc is None:
        _emit({"ev": "refused", "error": "stdio_tests runs only in a zygote's child"})
        return
    import select
    import time

    _libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    limit = int(job["output_bytes"])
    timeout_s = float(job["test_timeout_s"])
    me = str(os.getpid())
    for index, text in enumerate(job["inputs"]):
        status, exit_code, out, channel, err = _one_stdio_test(
            code, text.encode(), limit, timeout_s, me, select, time
        )
        if status != "exited":
            out = channel = b""
        head = err[:_STDERR_HEAD]
        _write_all(1, out + channel + head)
        _emit(
            {
                "ev": "test",
                "i": index,
                "status": status,
                "code": exit_code,
                "out": len(out),
                "ch": len(channel),
                "err": len(head),
            }
        )
        if not _tidy(me):
            _emit({"ev": "unclean"})
            return
        if status == "timeout":
            return


def _tidy(me):
    """Between two tests: what the last one left, gone (the common case, nothing left, checked cheaply first)."""
    if _others(me) and not _kill_others("1", me):
        return False
    for path, mode in _writable_modes.items():
        try:
            if os.stat(path).st_mode & 0o7777 == mode and not os.listdir(path):
                continue
        except OSError:
            pass
        if not _empty_writable({path: mode}):
            return False
    return True


def _others(me):
    return [name for name in os.listdir("/proc") if name.isdigit() and name not in ("1", me)]


def _write_all(fd, data):
    while data:
        data = data[os.write(fd, data) :]


def _one_stdio_test(code, stdin, limit, timeout_s, me, select, time):
    """One test in a forked child: (status, exit status or None, stdout, channel, stderr). The test ends when the
    child has exited (what it left running is killed then, as the zygote does after a run) and its outputs have
    closed; or at its wall clock, or when an output passes ``limit``."""
    pipes = [os.pipe() for _ in range(4)]
    pid = os.fork()
    if pid == 0:
        try:
            os.dup2(pipes[0][0], 0)
            for target in (1, 2, 3):
                os.dup2(pipes[target][1], target)
            os.closerange(4, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
            _libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)  # its own /proc files are its own, as in a run of its own
            _run_stdio(code)
            _finish()
        finally:
            os._exit(70)
    pidfd = os.pidfd_open(pid)
    os.close(pipes[0][0])
    for target in (1, 2, 3):
        os.close(pipes[target][1])
    writer = pipes[0][1]
    readers = {pipes[1][0]: bytearray(), pipes[2][0]: bytearray(), pipes[3][0]: bytearray()}
    poller = select.poll()
    for fd in (*readers, pidfd):
        poller.register(fd, select.POLLIN)
    if stdin:
        os.set_blocking(writer, False)
        poller.register(writer, select.POLLOUT)
    else:
        os.close(writer)
        writer = -1
    deadline = time.monotonic() + timeout_s
    status = "exited"
    exit_code = None
    open_readers = len(readers)
    try:
        while (open_readers or exit_code is None) and status == "exited":
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                status = "timeout"
                break
            for fd, _ in poller.poll(remaining * 1000):
                if fd == pidfd:
                    poller.unregister(pidfd)
                    exit_code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
                    if _others(me):
                        _kill_others("1", me)  # what it left running holds its outputs open
                elif fd == writer:
                    try:
                        stdin = stdin[os.write(writer, stdin[: 1 << 16]) :]
                    except BlockingIOError:
                        continue
                    except OSError:
                        stdin = b""  # the test stopped reading
                    if not stdin:
                        poller.unregister(writer)
                        os.close(writer)
                        writer = -1
                else:
                    chunk = os.read(fd, 1 << 16)
                    if not chunk:
                        poller.unregister(fd)
                        open_readers -= 1
                        continue
                    readers[fd] += chunk
                    if len(readers[fd]) > limit:
                        status = "output_limit"
                        break
    finally:
        for fd in (writer, pidfd, *readers):
            if fd >= 0:
                try:  # noqa: SIM105 - as in _finish
                    os.close(fd)
                except OSError:
                    pass
    if status != "exited":
        exit_code = None
        try:  # noqa: SIM105 - as in _finish
            os.kill(pid, 9)
        except OSError:
            pass
    out, err, channel = readers.values()
    return status, exit_code, bytes(out), bytes(channel), bytes(err)


def run_job(job, marker=None):
    """Run one job; ``marker`` set means remote mode (events on stderr, each line prefixed with it)."""
    global _marker
    if marker is not None:
        _marker = marker.encode()
    _apply_limits(job["limits"])
    # The worker starts the sandbox with no environment; this drops what the interpreter set itself (PEP 538's
    # LC_CTYPE), so the program and its children see none at all.
    os.environ.clear()
    builtins.exit = _Quitter("exit")
    builtins.quit = _Quitter("quit")
    mode = job["mode"]
    if mode == "check":
        # The checker's code comes with its first job (only checker sandboxes compile it).
        namespace = {"__name__": "__checker__", "__builtins__": builtins}
        exec(compile(job["checker"], "checker.py", "exec"), namespace)
        namespace["serve_checks"](job, _private_stdin(), _emit, encode, decode)
        _finish()
    requests = _private_stdin() if mode == "serve" else None
    try:
        code = compile(job["code"], "solution.py", "exec")
    except BaseException as err:
        _emit({"ev": "syntax_error", "error": _error_name(err)})
        _finish()
    if mode == "stdio":
        _run_stdio(code)
    elif mode == "stdio_tests":
        _run_stdio_tests(code, job)
    elif mode == "call":
        _run_call(code, job["fn_name"], job["calls"])
    else:
        _run_serve(code, requests)
    _finish()


def _read_exactly(fd, size):
    chunks = []
    while size:
        chunk = os.read(fd, size)
        if not chunk:
            raise EOFError("stdin closed before the whole job arrived")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def serve(channel_fd):
    """Local mode: announce readiness, read one job from stdin (byte by byte up to the newline), run it."""
    global _channel_fd
    _channel_fd = channel_fd
    _emit({"ev": "ready"})
    _serve_one()


def _serve_one():
    header = b""
    while not header.endswith(b"\n"):
        header += _read_exactly(0, 1)
    run_job(_loads(_read_exactly(0, int(header))))


# ---- reused sandboxes: the zygote ----

#: Modules loaded once by the zygote, so that a run that imports them finds them loaded (copy-on-write after fork).
_PRELOAD = ("collections", "functools", "heapq", "bisect", "itertools", "math", "string", "re")
#: Entries a run may leave in /tmp and /dev/shm; more, and the zygote retires rather than spend long cleaning.
_MAX_LEFT_ENTRIES = 10000
_PR_SET_DUMPABLE = 4
_PR_SET_CHILD_SUBREAPER = 36
#: Set by the zygote in its children: the C library, and the modes of the directories a run may write.
_libc = None
_writable_modes = None


def zygote(control_fd):
    """Reused local mode: this process (the sandbox's PID 1) forks one child per job and is the same before each.

    Per job, the worker sends four descriptors over the ``control_fd`` socket: the run's stdin, stdout, stderr and
    channel. The child makes them its 0, 1, 2 and 3, closes everything else (the control socket included), and
    serves the job as ``serve`` does. When the child has exited, the zygote kills every other process of its PID
    namespace (what the program left running), reaps them, empties ``/tmp`` and ``/dev/shm`` and checks that no
    System V IPC object is left; then it answers ``{"ev": "exit", "code": ..., "clean": ...}``. Not clean: it
    exits, and the worker starts another sandbox. The zygote never reads a job itself and is not dumpable, so a
    run can neither read nor change it (``/proc/1/mem``); signals from inside do not reach it (PID 1).
    """
    import ctypes
    import socket

    if os.getpid() != 1:
        # Its clean-up kills every other process it can signal: only as the PID 1 of a namespace of its own.
        os.write(2, b"the zygote runs only as the PID 1 of its own PID namespace\n")
        os._exit(3)
    libc = ctypes.CDLL(None, use_errno=True)
    for name in _PRELOAD:
        try:  # noqa: SIM105 - as in _finish
            __import__(name)
        except BaseException:
            pass
    while control_fd <= 3:
        control_fd = os.dup(control_fd)  # 0-3 are the run's
    libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    control = socket.socket(fileno=control_fd)
    modes = {path: os.stat(path).st_mode & 0o7777 for path in ("/tmp", "/dev/shm")}
    global _libc, _writable_modes
    _libc, _writable_modes = libc, modes
    # First calls pay one-time set-up (compile's alone about 0.7 ms): paid here, once, rather than by every child.
    warm_up = "def _f(x):\n    return [f'{i}' for i in range(x)] + list({1: 2.5}.items())\n_f(3)\n"
    exec(compile(warm_up, "<zygote>", "exec"), {"__builtins__": builtins})
    _loads(_dumps({"a": [1, 2.5, "x", None, True, {"b": []}]}))
    control.sendall(b'{"ev":"ready"}\n')
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(control, 64, 4)
        except OSError:
            os._exit(0)
        if message != b"run" or len(fds) != 4:
            os._exit(0)  # the worker closed its end (or spoke nonsense): nothing more to serve
        pid = os.fork()
        if pid == 0:
            try:
                _zygote_child(fds, libc)
            finally:
                os._exit(70)
        for fd in fds:
            os.close(fd)
        _, status = os.waitpid(pid, 0)
        try:
            clean = _end_run(modes)
        except BaseException:
            clean = False
        control.sendall(
            _dumps({"ev": "exit", "code": os.waitstatus_to_exitcode(status), "clean": clean}).encode() + b"\n"
        )
        if not clean:
            os._exit(0)


def _zygote_child(fds, libc):
    global _channel_fd
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    os.closerange(4, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    _channel_fd = 3
    # Dumpable again (the zygote is not): the run's /proc files are its own, as in a sandbox of its own.
    libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)
    try:
        # The memory cgroup's OOM killer takes the run, not the zygote. (os-level: a text-mode open would import
        # the locale machinery in every child.)
        fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
        os.write(fd, b"1000")
        os.close(fd)
    except OSError:
        pass
    _serve_one()


def _end_run(modes):
    """Kill and reap what the run left, empty the writable directories; whether the sandbox is as it was."""
    if not _kill_others("1") or not _empty_writable(modes):
        return False
    for kind in ("shm", "sem", "msg"):
        try:
            with open(f"/proc/sysvipc/{kind}", "rb") as f:
                if len(f.read().splitlines()) > 1:
                    return False
        except OSError:
            pass
    return True


def _kill_others(*keep):
    """Kill (``kill(-1)``: every process this one may signal but the namespace's PID 1) and reap every process of
    the PID namespace but those in ``keep`` (pids as text); whether none is left after a few rounds. Only in a
    PID namespace whose PID 1 is the zygote: anywhere else ``kill(-1)`` would reach the host's processes."""
    for _ in range(10):
        try:  # noqa: SIM105 - as in _finish
            os.kill(-1, 9)
        except OSError:
            pass
        while True:
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                break
            except InterruptedError:
                continue
        if not [name for name in os.listdir("/proc") if name.isdigit() and name not in keep]:
            return True
    return False


def _empty_writable(modes):
    for path, mode in modes.items():
        try:
            os.chmod(path, mode)
        except OSError:
            return False
        if not _empty(path):
            return False
    return True


def _empty(top):
    """Remove everything under ``top`` (depth first, without recursion); whether it is empty after."""
    stack = [top]
    seen = 0
    while stack:
        path = stack[-1]
        try:
            entries = list(os.scandir(path))
        except OSError:
            try:
                os.chmod(path, 0o700)
                entries = list(os.scandir(path))
            except OSError:
                return False
        seen += len(entries)
        if seen > _MAX_LEFT_ENTRIES:
            return False
        pushed = False
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    os.chmod(entry.path, 0o700)
                    stack.append(entry.path)
                    pushed = True
                else:
                    os.unlink(entry.path)
            except OSError:
                return False
        if not pushed:
            stack.pop()
            if path != top:
                try:
                    os.rmdir(path)
                except OSError:
                    return False
    try:
        return not os.listdir(top)
    except OSError:
        return False


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    serve(int(sys.argv[2]))
elif __name__ == "__main__" and sys.argv[1:2] == ["zygote"]:
    zygote(int(sys.argv[2]))
