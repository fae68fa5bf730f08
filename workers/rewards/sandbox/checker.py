"""The checker: runs a dataset's assert-style or ``check(candidate)`` tests against a program in another sandbox.

Its source travels with the first job of a checker sandbox and runs inside the harness (``harness.py``, mode
``check``), which hands it the harness's channel writer and value format. Standard library only.

Every name a test does not define and that is not a built-in is the program's: looking it up is a request (see
``relay.py``), answered with plain data, or with a ``Handle`` when the value is not plain data (a function, a
class, an instance); a name that gave a handle is not asked again within the job (plain data always is). A handle can be called, its attributes read and its items listed, each by request; it
compares equal only to itself, so an object whose ``__eq__`` always says True is worth nothing here. An exception
the program raised is raised again here under its built-in class when it has one (so ``except ValueError`` in a
test works), else as ``ProgramError``; lists, dicts and sets passed to the program and changed by it in place are
changed here too.

Verdicts: ``passed`` (the test ran to its end), ``wrong_answer`` (an assert failed, or the test could not use what
the program returned), ``runtime_error`` / ``memory_limit`` (the program raised and the test did not catch it),
the reason the program's sandbox ended (``timeout``, ``output_limit``, ...), or ``unsupported: ...`` when the test
hands the program something that is not plain data (a fault of the dataset, not the program).

A checker sandbox serves one job after another (starting one costs more than most checks); the worker kills it
whenever a job does not end cleanly.
"""

import builtins
import contextlib
import sys


class ProgramGone(BaseException):
    """The program's sandbox ended (timeout, crash, too much output): no further request can be answered."""


class ProgramError(Exception):
    """The program raised an exception that is not a built-in one."""


class Unsupported(BaseException):
    """The test hands the program a value that is not plain data (a function, an object of the test's own)."""


class _Checker:
    """The checker's side of one job: requests out on the channel, answers in on stdin."""

    def __init__(self, answers, emit, encode, decode):
        self.answers = answers
        self.emit, self.encode, self.decode = emit, encode, decode
        self.next_id = 0
        self.raised = []
        self.gone = None
        #: Names of the program already looked up that stand for a handle (a function, a class): asked once.
        self.named_handles = {}

    def lookup(self, name):
        if name in self.named_handles:
            return self.named_handles[name]
        value = self.request({"op": "get", "name": name})
        if type(value) is Handle:
            self.named_handles[name] = value
        return value

    def request(self, message, sent_args=()):
        if self.gone is not None:
            raise ProgramGone(self.gone)
        message["id"] = self.next_id
        self.next_id += 1
        self.emit(message)
        answer = self.answers.next()
        if type(answer) is not dict or answer.get("id") != message["id"]:
            self.gone = "runtime_error"
            raise ProgramGone(self.gone)
        if "gone" in answer:
            self.gone = str(answer["gone"])
            raise ProgramGone(self.gone)
        for arg, now in zip(sent_args, answer.get("a") or (), strict=False):
            _update_in_place(arg, now, self.decode)
        if "h" in answer:
            if type(answer["h"]) is not int:
                self.gone = "wrong_answer"
                raise ProgramGone(self.gone)
            return Handle(self, answer["h"])
        if "v" in answer:
            try:
                return self.decode(answer["v"])
            except (ValueError, TypeError, RecursionError):
                # Not something the harness sends: the program wrote on the channel itself.
                self.gone = "wrong_answer"
                raise ProgramGone(self.gone) from None
        name = answer.get("e")
        kind = getattr(builtins, name, None) if type(name) is str else None
        if not (isinstance(kind, type) and issubclass(kind, Exception)):
            kind = ProgramError
        err = kind(f"raised by the program: {name}")
        err.program_error = str(name)
        self.raised.append(err)
        raise err

    def send(self, value):
        try:
            return self.encode(
                value, 0, lambda v: v.number if type(v) is Handle and v.checker is self else None
            )
        except TypeError as err:
            raise Unsupported(str(err)) from None


def _update_in_place(arg, now, decode):
    try:
        value = decode(now)
    except (ValueError, TypeError, RecursionError):
        return
    if type(arg) is not type(value):
        return
    if type(arg) is list:
        arg[:] = value
    elif type(arg) in (dict, set):
        arg.clear()
        arg.update(value)


class Handle:
    """Something of the program's that is not plain data: it can be called, and its attributes read, by request.
    It compares equal only to itself, whatever the program's object would say."""

    __slots__ = ("checker", "number")

    def __init__(self, checker, number):
        self.checker = checker
        self.number = number

    def __call__(self, *args, **kwargs):
        sent = [self.checker.send(a) for a in args]
        kw = [[k, self.checker.send(v)] for k, v in kwargs.items()]
        return self.checker.request({"op": "call", "h": self.number, "args": sent, "kw": kw}, args)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self.checker.request({"op": "attr", "h": self.number, "name": name})

    def __iter__(self):
        return iter(self.checker.request({"op": "list", "h": self.number}))

    def __repr__(self):
        return f"<program object #{self.number}>"


class _TestGlobals(dict):
    """A test's namespace: names it does not define (and that are not built-ins) are the program's."""

    def __init__(self, checker):
        super().__init__(__name__="__test__", __builtins__=builtins)
        self.checker = checker

    def __missing__(self, name):
        if name.startswith("__") or hasattr(builtins, name):
            raise KeyError(name)
        return self.checker.lookup(name)


def _verdict(checker, err):
    """The outcome of a test that raised ``err`` (``None``: it ran to the end)."""
    if checker.gone is not None:
        return checker.gone
    if err is None:
        return "passed"
    if isinstance(err, Unsupported):
        return "unsupported: " + str(err)
    if any(err is raised for raised in checker.raised):
        name = err.program_error
        return (
            "memory_limit"
            if name == "MemoryError"
            else "wrong_answer"
            if name == "Unreportable"
            else "runtime_error"
        )
    return "wrong_answer"


def run_check(job, checker):
    """Run each test of ``job`` against the program; one ``{"t": i, "r": outcome}`` per test."""
    entry_point = job.get("entry_point")
    for test, source in enumerate(job["tests"]):
        namespace = _TestGlobals(checker)
        checker.raised = []
        error = None
        try:
            if job.get("setup"):
                exec(compile(job["setup"], "setup.py", "exec"), namespace)
            exec(compile(source, f"test_{test}.py", "exec"), namespace)
            if entry_point is not None:
                candidate = checker.lookup(entry_point)
                namespace["check"](candidate)
        except BaseException as err:
            error = err
        checker.emit({"t": test, "r": _verdict(checker, error)})


def serve_checks(job, answers, emit, encode, decode):
    """Run jobs until stdin ends: this one, then each ``{"job": ...}`` line that follows its ``done``."""
    while True:
        run_check(job, _Checker(answers, emit, encode, decode))
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):
                stream.flush()
        emit({"ev": "done"})
        job = None
        while job is None:
            message = answers.next()
            if message is None:
                return
            if type(message) is dict and type(message.get("job")) is dict:
                job = message["job"]
