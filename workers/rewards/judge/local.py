"""The ``ray_actor`` backend of the llm_judge reward: the judge is a Hugging Face causal LM loaded with
``from_pretrained`` inside a Ray actor, generating with the batching ``Engine`` of `roll serve`.

Where each piece runs, and why:

- **The judge actor** (``JudgeActor``) holds one ``workers.inference.engine.Engine``. It is a threaded actor:
  every call waits in its own thread for the engine, whose batcher joins the requests waiting at a moment into
  one ``generate`` call, so samples judged at the same time are judged in one batch.
- **The relay** (``JudgeRelay``) runs in the reward worker's own process, which is connected to Ray (the
  ``RewardWorker`` Ray actor in a run). It creates the judge actor when the scorer is first built there (the
  ``RewardWorker`` builds one to check its options before it starts its pool), waits until the model is
  loaded, and from then on forwards each request of the worker's scoring processes to the actor.
- **The scoring processes** of the worker's pool (``workers.rewards.pool``, started from a fork server) call
  the judge through the relay (``LocalChatClient``), over a local socket, with the retries of
  ``workers.rewards.retry``; they never connect to Ray themselves.

Why a relay rather than scoring processes that join Ray (``ray.init(address="auto")`` in each one): a process
that joins Ray becomes a Ray driver (a job) of its own, with its own connections to the cluster, and the pool
starts one per ``num_processes`` and another after every timeout; ``"auto"`` picks the cluster started last on
the machine when several run (Ray's own rule), which need not be this run's; and a judge actor created by a
scoring process would be owned by it and die when the pool kills that process at a sample's timeout (or,
detached, outlive the run). Through the
relay, only the worker's process talks to Ray, the judge actor is owned by it (so it lives exactly as long as
the worker: ``ray.kill`` of the worker or the end of the run takes it down), and a scoring process killed at
its timeout only drops a socket.

The scoring processes find the relay with nothing passed to them: its socket's address is derived from
``multiprocessing``'s authentication key, which every process of the pool inherits from the worker's process
(documented ``multiprocessing`` behaviour), and the connection is authenticated with that same key. A scorer
built in a process that is not connected to Ray (``roll rewards score``, ``roll run --dry-run``) starts no
relay; scoring processes whose parent has none fail to start, with a message that says so.

Failures mask the sample, never score it 0 (``workers.rewards.llm_judge``): a judge actor that died
(``ray.kill``, a crash) answers ``JudgeUnreachable`` at once, a judge that gives no reply within
``request_timeout_s`` (still loading, overloaded, restarting) is retried with backoff and then is
``JudgeUnreachable``, and a prompt longer than the judge's context is ``JudgeRejected``. Ray restarts a judge
actor that crashed up to ``max_restarts`` times (the model is loaded again); one killed with ``ray.kill`` stays
dead, and every later sample of the run is masked and counted.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import multiprocessing
import os
import random
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

from workers.rewards.judge.client import ChatReply
from workers.rewards.judge.errors import JudgeRejected, JudgeUnreachable
from workers.rewards.retry import RetryPolicy

logger = logging.getLogger(__name__)

#: Beyond ``request_timeout_s``: the relay's wait for the actor, then a scoring process's wait for the relay,
#: so that the inner side always answers first and says why.
_GRACE_S = 2.0
#: Threads of the judge actor per sequence of a batch: requests beyond a batch wait in the engine's queue,
#: where the next batch takes them, rather than in Ray's.
_THREADS_PER_SEQUENCE = 4

# What the relay answers a scoring process: ("ok", reply dict), or a failure and its message.
_OK, _RETRY, _DEAD, _REJECTED = "ok", "retry", "dead", "rejected"


class PromptRejected(ValueError):
    """The judge actor refuses a request that would fail again the same way (a prompt longer than the
    context)."""


class JudgeBusy(RuntimeError):
    """The judge actor gave no reply in time (and dropped the request); another attempt may succeed."""


@dataclass(frozen=True)
class LocalJudgeSpec:
    """The judge model and its actor: ``model_path`` plus the scorer's ``actor`` options, each documented at
    its field."""

    #: The judge's weights: a Hugging Face folder, or a run's output folder or checkpoint (as `roll serve`
    #: takes them). Absolute here; the option may be relative to the working directory.
    model_path: str
    #: Weights' dtype: float32, bfloat16 or float16.
    dtype: str = "float32"
    #: Most sequences the engine generates in one batch.
    max_batch_size: int = 32
    #: torch intra-op threads of the actor.
    torch_threads: int = 1
    #: The actor's CPUs and GPUs for Ray's scheduling. 0 CPUs by default: the pipeline sizes its local Ray
    #: cluster for its own workers, and an actor that asks for more than is free never starts.
    num_cpus: float = 0.0
    num_gpus: float = 0.0
    #: Times Ray restarts a judge actor that crashed (a ``ray.kill`` is never undone).
    max_restarts: int = 3
    #: The actor's name in the job's namespace (``ray.get_actor(name)``); reward workers that give the same
    #: name share one judge, owned by the first (default: one judge per reward worker).
    name: str | None = None
    #: How long the reward worker waits for the judge to load its model before it gives up with an error.
    load_timeout_s: float = 600.0

    @classmethod
    def from_options(cls, model_path: object, actor: object) -> LocalJudgeSpec:
        """Check the scorer's ``model_path`` and ``actor`` options; raises ``ValueError`` naming the problem."""
        from workers.inference.model_path import resolve_model_path

        if not model_path or not isinstance(model_path, str):
            raise ValueError(
                "llm_judge: backend ray_actor needs options.model_path, the judge model's folder "
                "(absolute, or relative to the working directory)"
            )
        if not isinstance(actor, dict):
            raise ValueError(f"llm_judge: options.actor must be a mapping, got {actor!r}")
        known = {f.name for f in dataclasses.fields(cls)} - {"model_path"}
        unknown = sorted(set(actor) - known)
        if unknown:
            raise ValueError(f"llm_judge: unknown options.actor key(s) {unknown}; known: {sorted(known)}")
        absolute = str(Path(model_path).expanduser().resolve())
        resolve_model_path(absolute)  # raises ModelPathError (a ValueError) saying what was looked for
        spec = cls(model_path=absolute, **actor)
        spec._check()
        return spec

    def _check(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(
                f"llm_judge: actor.dtype must be float32, bfloat16 or float16, got {self.dtype!r}"
            )
        for name in ("max_batch_size", "torch_threads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"llm_judge: actor.{name} must be an integer >= 1, got {value!r}")
        for name in ("num_cpus", "num_gpus"):
            if not isinstance(getattr(self, name), int | float) or getattr(self, name) < 0:
                raise ValueError(
                    f"llm_judge: actor.{name} must be a number >= 0, got {getattr(self, name)!r}"
                )
        if not isinstance(self.max_restarts, int) or self.max_restarts < -1:
            raise ValueError(
                f"llm_judge: actor.max_restarts must be an integer >= -1, got {self.max_restarts!r}"
            )
        if self.name is not None and (not isinstance(self.name, str) or not self.name):
            raise ValueError(f"llm_judge: actor.name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.load_timeout_s, int | float) or self.load_timeout_s <= 0:
            raise ValueError(f"llm_judge: actor.load_timeout_s must be > 0, got {self.load_timeout_s!r}")

    def key(self) -> str:
        """The same string in the worker's process and in its scoring processes."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


def relay_address(spec: LocalJudgeSpec) -> str:
    """The relay's socket for ``spec`` in this process tree: named by a hash of the process tree's
    ``multiprocessing`` authentication key and the spec (an abstract socket on Linux, a file elsewhere)."""
    secret = bytes(multiprocessing.current_process().authkey)
    digest = hashlib.sha256(secret + spec.key().encode()).hexdigest()[:32]
    if sys.platform.startswith("linux"):
        return f"\0roll-judge-{digest}"
    return os.path.join(tempfile.gettempdir(), f"roll-judge-{digest}.sock")


# --- the actor ----------------------------------------------------------------------------------------------


class JudgeActor:
    """The judge model in a Ray actor (created by ``JudgeRelay`` as a threaded actor); calls from several
    threads at once are batched by the engine."""

    def __init__(self, model_path: str, dtype: str, max_batch_size: int, torch_threads: int) -> None:
        import torch

        from workers.inference.engine import Engine
        from workers.inference.model_path import resolve_model_path

        torch.set_num_threads(torch_threads)
        self.engine = Engine(resolve_model_path(model_path), dtype=dtype, max_batch_sequences=max_batch_size)

    def ready(self) -> bool:
        return True

    def stats(self) -> dict[str, float]:
        """The engine's counts: ``requests``, ``completed``, ``aborted``, ``batches``, ``mean_batch_sequences``."""
        return self.engine.stats()

    def chat(
        self, messages: list[dict[str, str]], max_tokens: int, temperature: float, timeout_s: float
    ) -> dict:
        """The judge's reply to one chat: ``{"text", "prompt_tokens", "completion_tokens"}``.

        Raises ``PromptRejected`` for a prompt that leaves no room in the context, ``JudgeBusy`` when the reply
        takes longer than ``timeout_s`` (the request is then dropped from the engine).
        """
        from workers.inference.engine import SamplingParams

        ids = self.engine.chat_prompt(messages)
        budget = max_tokens
        context = self.engine.context_length
        if context is not None:
            if len(ids) >= context:
                raise PromptRejected(
                    f"the prompt is {len(ids)} tokens; the judge's context is {context} tokens"
                )
            budget = min(budget, context - len(ids))
        request_id = self.engine.new_request_id()
        future = self.engine.submit(
            request_id, [ids], SamplingParams(max_tokens=budget, temperature=temperature)
        )
        try:
            choices = future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            self.engine.abort(request_id)
            raise JudgeBusy(f"no reply within {timeout_s:g}s") from None
        if choices is None:
            raise JudgeBusy("the request was aborted")
        return {"text": choices[0].text, "prompt_tokens": len(ids), "completion_tokens": choices[0].tokens}


# --- the relay, in the reward worker's process --------------------------------------------------------------

_RELAYS: dict[str, JudgeRelay] = {}
_RELAYS_LOCK = threading.Lock()


def connected_to_ray() -> bool:
    """Whether this process has joined a Ray cluster (without importing Ray where nothing has)."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def ensure_relay(spec: LocalJudgeSpec) -> JudgeRelay:
    """The relay of ``spec`` in this process, with its judge actor up in the current Ray session: started (and
    the actor created and loaded) on first use. Raises ``RuntimeError`` when the judge cannot start."""
    with _RELAYS_LOCK:
        relay = _RELAYS.get(spec.key())
        if relay is None:
            relay = _RELAYS[spec.key()] = JudgeRelay(spec)
    relay.connect()
    return relay


def _ray_session() -> tuple[str, str]:
    import ray

    context = ray.get_runtime_context()
    return context.gcs_address, context.get_node_id()


class JudgeRelay:
    """Listens on ``relay_address(spec)`` and answers each scoring process's requests by calling the judge
    actor; one thread per connected process. The listener lives as long as the process; the actor is made for
    each Ray session the process joins (``connect``)."""

    def __init__(self, spec: LocalJudgeSpec) -> None:
        self.spec = spec
        self.actor: Any = None
        self.actor_name: str | None = None
        self._session: tuple[str, str] | None = None
        self._lock = threading.Lock()
        authkey = bytes(multiprocessing.current_process().authkey)
        self._listener = Listener(relay_address(spec), family="AF_UNIX", authkey=authkey)
        threading.Thread(target=self._accept, name="llm-judge-relay", daemon=True).start()

    def connect(self) -> None:
        """Create the judge actor in the current Ray session (or find the one named ``spec.name``) and wait
        until it has loaded its model; nothing to do when that was done already."""
        import ray

        with self._lock:
            session = _ray_session()
            if self._session == session:
                return
            spec = self.spec
            worker_id = ray.get_runtime_context().get_worker_id()
            name = spec.name or f"llm-judge-{Path(spec.model_path).name}-{worker_id[:12]}"
            actor = (
                ray.remote(JudgeActor)
                .options(
                    name=name,
                    get_if_exists=True,
                    max_concurrency=_THREADS_PER_SEQUENCE * spec.max_batch_size,
                    max_restarts=spec.max_restarts,
                    num_cpus=spec.num_cpus,
                    num_gpus=spec.num_gpus,
                    runtime_env={
                        "env_vars": {
                            "OMP_NUM_THREADS": str(spec.torch_threads),
                            "TOKENIZERS_PARALLELISM": "false",
                        }
                    },
                )
                .remote(spec.model_path, spec.dtype, spec.max_batch_size, spec.torch_threads)
            )
            started = time.monotonic()
            try:
                ray.get(actor.ready.remote(), timeout=spec.load_timeout_s)
            except ray.exceptions.GetTimeoutError:
                ray.kill(actor)
                raise RuntimeError(
                    f"llm_judge: the judge actor {name!r} did not load {spec.model_path} within "
                    f"{spec.load_timeout_s:g}s (does the Ray cluster have the num_cpus={spec.num_cpus:g} and "
                    f"num_gpus={spec.num_gpus:g} it asks for? see options.actor)"
                ) from None
            except ray.exceptions.RayActorError as err:
                raise RuntimeError(
                    f"llm_judge: the judge actor {name!r} could not load {spec.model_path}: {err}"
                ) from None
            logger.info(
                "llm_judge: judge actor %r loaded %s in %.1fs",
                name,
                spec.model_path,
                time.monotonic() - started,
            )
            self.actor, self.actor_name, self._session = actor, name, session

    def _accept(self) -> None:
        while True:
            try:
                conn = self._listener.accept()
            except (OSError, EOFError, multiprocessing.AuthenticationError) as err:
                logger.warning("llm_judge: relay refused a connection: %r", err)
                # An error of the listener itself (too many open files) would repeat at once.
                time.sleep(0.1)
                continue
            threading.Thread(
                target=self._serve, args=(conn,), name="llm-judge-relay-conn", daemon=True
            ).start()

    def _serve(self, conn: Connection) -> None:
        with conn:
            while True:
                try:
                    messages, max_tokens, temperature, timeout_s = conn.recv()
                except (EOFError, OSError):  # the scoring process closed or died
                    return
                reply = self._ask(messages, max_tokens, temperature, timeout_s)
                try:
                    conn.send(reply)
                except OSError:
                    return

    def _ask(
        self, messages: list[dict[str, str]], max_tokens: int, temperature: float, timeout_s: float
    ) -> tuple:
        import ray
        from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError

        actor, name = self.actor, self.actor_name
        if actor is None:
            return _DEAD, "the judge actor was never started in this process"
        try:
            ref = actor.chat.remote(messages, max_tokens, temperature, timeout_s)
            return _OK, ray.get(ref, timeout=timeout_s + _GRACE_S)
        except GetTimeoutError:
            return _RETRY, f"no reply from the judge actor {name!r} within {timeout_s:g}s"
        except ActorUnavailableError as err:
            return _RETRY, f"the judge actor {name!r} is unavailable: {err}"
        except RayActorError as err:
            return _DEAD, f"the judge actor {name!r} died: {err}"
        except RayTaskError as err:
            if isinstance(err.cause, PromptRejected):
                return _REJECTED, str(err.cause)
            return _RETRY, f"the judge actor {name!r} failed: {err.cause!r}"
        except Exception as err:  # Ray shut down under the relay, a handle of a past session: no verdict
            return _DEAD, f"the judge actor {name!r} cannot be called: {err!r}"


# --- the client, in each scoring process --------------------------------------------------------------------


class LocalChatClient:
    """A scoring process's side: ``chat(messages)`` returns the judge's ``ChatReply`` or raises a
    ``JudgeError``, like ``workers.rewards.judge.client.ChatClient`` does for an HTTP judge."""

    def __init__(
        self,
        spec: LocalJudgeSpec,
        *,
        timeout_s: float,
        retry: RetryPolicy,
        sleep: Callable[[float], None] = time.sleep,
        rng: random.Random | None = None,
    ) -> None:
        self.spec = spec
        self.timeout_s = timeout_s
        self.retry = retry
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._conn: Connection | None = None

    def connect(self) -> None:
        """Connect to the relay of this process's reward worker; raises ``RuntimeError`` when there is none."""
        if self._conn is not None:
            return
        authkey = bytes(multiprocessing.current_process().authkey)
        try:
            self._conn = Client(relay_address(self.spec), family="AF_UNIX", authkey=authkey)
        except (OSError, EOFError, multiprocessing.AuthenticationError) as err:
            raise RuntimeError(
                "llm_judge: backend ray_actor: no judge relay in the reward worker's process "
                f"({err!r}); the reward worker must run in a process connected to Ray (as in `roll run`)"
            ) from None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def chat(self, messages: list[dict[str, str]], *, max_tokens: int, temperature: float = 0.0) -> ChatReply:
        started = time.monotonic()
        failure = ""
        attempts = 0
        for attempt in range(self.retry.max_retries + 1):
            if attempt:
                wait = self.retry.delay(attempt, self._rng)
                total = self.retry.total_timeout_s
                if total is not None and time.monotonic() - started + wait >= total:
                    break
                self._sleep(wait)
            attempts += 1
            kind, payload = self._request((messages, max_tokens, temperature, self.timeout_s))
            if kind == _OK:
                total_tokens = payload["prompt_tokens"] + payload["completion_tokens"]
                return ChatReply(text=payload["text"], attempts=attempts, total_tokens=total_tokens)
            if kind == _REJECTED:
                raise JudgeRejected(f"llm_judge: the judge actor refused the request: {payload}")
            failure = payload
            if kind == _DEAD:
                break
            logger.info("llm_judge: attempt %d at the judge actor failed (%s)", attempts, payload)
        raise JudgeUnreachable(
            f"llm_judge: no reply from the judge actor after {attempts} attempt(s) in "
            f"{time.monotonic() - started:.1f}s; last: {failure}"
        )

    def _request(self, request: tuple) -> tuple[str, Any]:
        try:
            self.connect()
        except RuntimeError as err:
            return _DEAD, str(err)
        try:
            self._conn.send(request)
            if self._conn.poll(self.timeout_s + 2 * _GRACE_S):
                return self._conn.recv()
            failure = f"no answer from the relay within {self.timeout_s + 2 * _GRACE_S:g}s"
        except (EOFError, OSError) as err:
            failure = f"the connection to the relay broke: {err!r}"
        # A late answer must not be taken for the next request's: start over on a new connection.
        self.close()
        return _RETRY, failure
