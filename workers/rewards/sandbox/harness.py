"""The in-sandbox harness: runs one untrusted program and reports what it produced, never a verdict.

This file is not imported by the worker: its source is executed by the sandbox's own interpreter (standard library
only, ``python -I -S -B``). Everything it reports is a *claim* about the program's behaviour: the JSON of each
call's return value, the values of the operands of each assert, whether the program finished. Expected outputs
never reach it, and the worker compares outside. A program that takes over this interpreter (patching these
functions, writing to the channel itself, walking frames) can therefore only claim outputs, which is no easier
than producing them.

Two ways in:

* local: ``python -c <this source> serve FD`` in a pre-started sandbox. It announces ``{"ev": "ready"}`` on the
  channel FD, then reads one job from stdin as ``<length>\\n<json>``; whatever follows on stdin is the program's
  own stdin. Events go to FD, one JSON object per line.
* remote: this source followed by ``run_job(<job>, <marker>)``, sent as one script; events go to stderr, each line
  prefixed with a random marker so the worker can find them among the program's own stderr.

Job modes: ``stdio`` runs the program as ``__main__`` and reports how it ended (stdout goes straight to the
worker); ``call`` calls ``fn_name`` (or ``Solution().fn_name``) with each argument list; ``probe`` runs each test's
setup statements and evaluates the operand expressions the worker took out of its asserts.
"""

import builtins
import contextlib
import json
import os
import resource
import sys

_MAX_DEPTH = 100
_channel_fd = 2
_marker = b""


def _emit(event):
    data = _marker + json.dumps(event, separators=(",", ":")).encode() + b"\n"
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


def encode(value, depth=0):
    """Tagged JSON of plain data; anything else (a subclass, an object with its own ``__eq__``) is refused."""
    kind = type(value)
    if kind is int and value.bit_length() > 63:
        # Hex, because decimal conversion of very long ints is capped (and slow) in both interpreters.
        return {"__t": "int", "v": format(value, "x")}
    if value is None or kind is bool or kind is int or kind is float or kind is str:
        return value
    if depth > _MAX_DEPTH:
        raise ValueError("value nested too deeply")
    if kind is list:
        return [encode(v, depth + 1) for v in value]
    if kind is tuple or kind is set or kind is frozenset:
        return {"__t": kind.__name__, "v": [encode(v, depth + 1) for v in value]}
    if kind is dict:
        return {"__t": "dict", "v": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    if kind is bytes:
        return {"__t": "bytes", "v": value.hex()}
    raise TypeError(f"cannot report a value of type {kind.__name__}")


def _error_name(err):
    return type(err).__name__


def _finish():
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    _emit({"ev": "done"})
    os._exit(0)


def _run_stdio(code):
    sys.argv = ["solution.py"]
    namespace = {"__name__": "__main__", "__builtins__": builtins}
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
    namespace = {"__name__": "__solution__", "__builtins__": builtins}
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
        args = json.loads(args_json)
        event = _report(test, lambda args=args: fn(*args))
        try:
            _emit(event)
        except ValueError:
            _emit({"t": test, "e": "Unreportable"})


def _run_probe(code, tests):
    namespace = _solution_namespace(code)
    if namespace is None:
        return
    for test, steps in enumerate(tests):
        probes = []
        try:
            for step in steps:
                if "exec" in step:
                    exec(compile(step["exec"], f"test_{test}.py", "exec"), namespace)
                else:
                    for source in step["eval"]:
                        expr = compile(source, f"test_{test}.py", "eval")
                        probes.append(_report(test, lambda expr=expr: eval(expr, namespace)))
        except BaseException as err:
            _emit({"t": test, "e": _error_name(err)})
            continue
        event = {"t": test, "p": [{k: v for k, v in p.items() if k != "t"} for p in probes]}
        try:
            _emit(event)
        except ValueError:
            _emit({"t": test, "e": "Unreportable"})


def run_job(job, marker=None):
    """Run one job; ``marker`` set means remote mode (events on stderr, each line prefixed with it)."""
    global _marker
    if marker is not None:
        _marker = marker.encode()
    _apply_limits(job["limits"])
    # The worker starts the sandbox with no environment; this drops what the interpreter set itself (PEP 538's
    # LC_CTYPE), so the program and its children see none at all.
    os.environ.clear()
    try:
        code = compile(job["code"], "solution.py", "exec")
    except BaseException as err:
        _emit({"ev": "syntax_error", "error": _error_name(err)})
        _finish()
    mode = job["mode"]
    if mode == "stdio":
        _run_stdio(code)
    elif mode == "call":
        _run_call(code, job["fn_name"], job["calls"])
    else:
        _run_probe(code, job["tests"])
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
    header = b""
    while not header.endswith(b"\n"):
        header += _read_exactly(0, 1)
    run_job(json.loads(_read_exactly(0, int(header))))


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    serve(int(sys.argv[2]))
