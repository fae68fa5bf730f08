"""A warm test runner for mutation testing: the third-party libraries are imported once, and each mutant's test
run is a fork of that process, so a mutant no longer pays torch's, transformers' and Ray's import (6 of the 8
seconds a mutant of the scheduler took).

    python mutation/warm.py serve SOCKET          the server: imports PRELOAD, then forks a run per request
    python mutation/warm.py run SOCKET -- ARGS    a client: pytest ARGS, run by the server in this directory

The client is what cosmic-ray runs as the test command; it exits with pytest's exit code and prints pytest's
output, as `python -m pytest ARGS` would. The server forks a handler per request and the handler forks the run:
the run moves to the client's directory and environment, puts that directory first on sys.path (as `python -m`
does), and calls pytest.main. Nothing of the project is imported before the fork (the server refuses to start if a
preload pulled in a project package), so the run imports the mutated module from the client's copy of the tree
as a fresh interpreter would. When the client goes away (cosmic-ray's timeout kills it), the handler kills the run
and everything it started.

Written to be run as a script (not `-m`): the server's sys.path then holds no project folder. The client imports
nothing but the standard library, so it starts in milliseconds."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import tempfile

#: Third-party modules the target tests import; the server imports them before it forks. Attribute lookups load
#: transformers' lazy classes (the tokenizer and model auto classes, most of transformers' import time).
PRELOAD = ["numpy", "torch", "ray", "ray.exceptions", "pytest", "transformers", "deepspeed"]
PRELOAD_ATTRS = [("transformers", "AutoTokenizer"), ("transformers", "AutoModelForCausalLM")]
#: The project's top-level packages: none may be imported before the fork.
PROJECT = ("roll_core", "roll_pipeline", "workers", "schedulers", "tests", "benchmarks", "mutation")
HERE = os.path.dirname(os.path.abspath(__file__))


def preload() -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    for module, attr in PRELOAD_ATTRS:
        getattr(sys.modules[module], attr)
    pulled = sorted(m for m in sys.modules if m.split(".")[0] in PROJECT)
    if pulled:
        raise SystemExit(f"warm runner: preloading imported project modules {pulled[:5]}; mutants would not be fresh")


def serve(path: str) -> None:
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
    preload()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # handlers are reaped by the kernel
    if os.path.exists(path):
        os.unlink(path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    print("warm runner ready", flush=True)
    while True:
        conn, _ = server.accept()
        if os.fork() == 0:
            server.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            try:
                handle(conn)
            finally:
                os._exit(0)
        conn.close()


def handle(conn: socket.socket) -> None:
    """One request: fork the run, wait for it, send back its exit code and output; kill it if the client goes."""
    request = json.loads(conn.makefile("r").readline())
    with tempfile.TemporaryFile() as out:
        pid = os.fork()
        if pid == 0:
            conn.close()
            os.setsid()
            code = 3
            try:
                code = run_tests(request, out.fileno())
            finally:
                os._exit(code)
        while True:
            readable, _, _ = select.select([conn], [], [], 0.05)
            if readable and not conn.recv(1):  # the client is gone: cosmic-ray's timeout killed it
                os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
        out.seek(0)
        output = out.read().decode(errors="replace")
    conn.sendall(json.dumps({"code": os.waitstatus_to_exitcode(status), "output": output}).encode() + b"\n")


def run_tests(request: dict, out_fd: int) -> int:
    """In the forked run: become the client's `python -m pytest ARGS` in its directory and environment."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [request["cwd"], *extra, *sys.path]
    sys.argv = ["pytest", *request["args"]]
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    import pytest

    # Plugins the preload imported (anyio's, by way of Ray and transformers) cannot have their asserts rewritten,
    # and pytest warns so; the project's modules are all imported after the fork, rewritten as in a fresh run.
    quiet = ["-W", "ignore::pytest.PytestAssertRewriteWarning"]
    code = int(pytest.main([*quiet, *request["args"]]))
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def client(path: str, args: list[str]) -> int:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    request = {"cwd": os.getcwd(), "env": dict(os.environ), "args": args}
    conn.sendall(json.dumps(request).encode() + b"\n")
    reply = conn.makefile("r").readline()
    if not reply:
        print("warm runner: the server closed the connection without an answer", file=sys.stderr)
        return 4
    answer = json.loads(reply)
    sys.stdout.write(answer["output"])
    return answer["code"]


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "serve":
        serve(argv[1])
        return 0
    if len(argv) >= 3 and argv[0] == "run" and argv[2] == "--":
        return client(argv[1], argv[3:])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
