"""The HTTP API of `roll serve`: the OpenAI endpoints a judge client or a chat client needs.

``GET /health``, ``GET /v1/models``, ``POST /v1/chat/completions`` and ``POST /v1/completions``, streaming
(server-sent events, ``stream: true``) or not, with ``n``, ``max_tokens`` (or ``max_completion_tokens``),
``temperature`` (0 is greedy), ``top_p``, ``top_k``, ``stop`` and ``stream_options.include_usage``. Options
that would change the answer and that this server cannot honour (``logprobs``, ``echo``, ``tools``,
``best_of``, a ``response_format`` other than text) are refused with a 400, not ignored. Errors have OpenAI's
shape, ``{"error": {"message", "type", "param", "code"}}``.

A request whose client goes away (a judge that gave up at its timeout) is aborted in the engine, so abandoned
work does not hold up the next batch.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from workers.inference.engine import Choice, Engine, SamplingParams

logger = logging.getLogger(__name__)

#: How often a waiting non-streaming request checks whether its client is still there.
DISCONNECT_POLL_S = 0.2
#: Most choices (prompts times n) one request may ask for.
MAX_CHOICES = 128


class APIError(Exception):
    def __init__(
        self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def _error_body(status: int, message: str, kind: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


class _Options(BaseModel):
    """Fields shared by both completion endpoints; unknown fields are accepted and ignored, like OpenAI's."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=-1)
    n: int = Field(default=1, ge=1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    logprobs: Any = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Options):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class CompletionRequest(_Options):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    best_of: int | None = None


def _message_text(message: ChatMessage) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    parts = []
    for part in message.content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(
                400, f"only text content parts are supported, got {part.get('type')!r}", param="messages"
            )
        parts.append(part["text"])
    return "".join(parts)


def _refuse_unsupported(body: _Options) -> None:
    if body.logprobs not in (None, False, 0):
        raise APIError(400, "logprobs are not supported by roll serve", param="logprobs")
    if body.tools:
        raise APIError(400, "tools are not supported by roll serve", param="tools")
    if body.response_format and body.response_format.get("type") not in (None, "text"):
        raise APIError(
            400, "only response_format type 'text' is supported by roll serve", param="response_format"
        )
    if isinstance(body, CompletionRequest):
        if body.echo:
            raise APIError(400, "echo is not supported by roll serve", param="echo")
        if body.best_of not in (None, body.n):
            raise APIError(400, "best_of is not supported by roll serve", param="best_of")


class _Server:
    """The handlers, over one engine serving one model name."""

    def __init__(self, engine: Engine, model_name: str, default_max_tokens: int) -> None:
        self.engine = engine
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.created = int(time.time())

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                kind="NotFoundError",
                param="model",
            )

    def params(self, body: _Options, prompts: list[list[int]], max_tokens: int | None) -> SamplingParams:
        if len(prompts) * body.n > MAX_CHOICES:
            raise APIError(400, f"at most {MAX_CHOICES} choices (prompts times n) per request", param="n")
        budget = max_tokens or self.default_max_tokens
        context = self.engine.context_length
        if context is not None:
            longest = max(len(p) for p in prompts)
            if longest >= context:
                raise APIError(
                    400,
                    f"the prompt is {longest} tokens; this model's context is {context} tokens",
                    param="messages" if isinstance(body, ChatRequest) else "prompt",
                )
            # Without an explicit max_tokens the reply may use the rest of the context; an explicit one is
            # kept within it too (finish_reason "length" tells the client).
            budget = min(budget, context - longest)
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        try:
            return SamplingParams(
                max_tokens=budget,
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=max(body.top_k, 0),
                n=body.n,
                stop=stop,
            )
        except ValueError as err:
            raise APIError(400, str(err)) from None

    async def wait(self, request: Request, request_id: str, prompts, params) -> list[Choice]:
        future = asyncio.wrap_future(self.engine.submit(request_id, prompts, params))
        aborted = False
        while True:
            done, _ = await asyncio.wait({future}, timeout=DISCONNECT_POLL_S)
            if done:
                break
            if not aborted and await request.is_disconnected():
                self.engine.abort(request_id)
                aborted = True
        try:
            result = future.result()
        except Exception as err:
            logger.exception("generation failed")
            raise APIError(500, f"generation failed: {err}", kind="server_error") from None
        if result is None:
            raise APIError(499, "the request was aborted", kind="aborted")
        return result

    async def stream(
        self,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        chunk: Callable[[int, str, str | None, bool], dict],
        usage_chunk: Callable[[dict], dict] | None,
        opening: bool,
    ) -> AsyncIterator[str]:
        """Server-sent events: with ``opening``, first a chunk per choice that opens it (chat's role chunk);
        then one per text delta and finish; the usage chunk if asked for; ``[DONE]``."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def on_delta(index: int, text: str, finish: str | None) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (index, text, finish))

        future = self.engine.submit(request_id, prompts, params, on_delta)
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(queue.put_nowait, None))
        try:
            for index in range(len(prompts) * params.n if opening else 0):
                yield _sse(chunk(index, "", None, True))
            while (item := await queue.get()) is not None:
                yield _sse(chunk(*item, False))
            try:
                choices = future.result()
            except Exception as err:  # headers are sent: the error goes in the stream
                logger.exception("generation failed")
                yield _sse(_error_body(500, f"generation failed: {err}", "server_error"))
                return
            if choices is not None and usage_chunk is not None:
                yield _sse(usage_chunk(_usage(prompts, choices)))
            yield "data: [DONE]\n\n"
        finally:
            if not future.done():
                self.engine.abort(request_id)


class _ApiKeyGuard:
    """Refuses /v1 requests without ``Authorization: Bearer <api_key>``. A plain ASGI middleware on purpose:
    Starlette's ``BaseHTTPMiddleware`` (``@app.middleware("http")``) keeps a client's disconnect from reaching the
    endpoint, so a request whose client gave up could not be aborted."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        guarded = scope["type"] == "http" and scope["path"].startswith("/v1/")
        if guarded and dict(scope["headers"]).get(b"authorization") != self.expected:
            body = _error_body(401, "missing or wrong API key", "authentication_error")
            await JSONResponse(body, status_code=401)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _envelope(
    request_id: str, created: int, model: str, kind: str, choices: list[dict], usage: dict | None = None
) -> dict:
    """The fields every completion object and stream chunk shares, around its ``choices``."""
    body = {"id": request_id, "object": kind, "created": created, "model": model, "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return body


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _usage(prompts: list[list[int]], choices: list[Choice]) -> dict[str, int]:
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(c.tokens for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def create_app(
    engine: Engine, model_name: str, *, api_key: str | None = None, default_max_tokens: int = 256
) -> FastAPI:
    """The FastAPI application serving ``engine`` as ``model_name``; with ``api_key``, /v1 requests must carry
    ``Authorization: Bearer <api_key>``."""
    server = _Server(engine, model_name, default_max_tokens)
    app = FastAPI(title="roll serve", version="1", docs_url=None, redoc_url=None)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, err: APIError) -> JSONResponse:
        return JSONResponse(_error_body(err.status, err.message, err.kind, err.param), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, err: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'] if p != 'body')}: {e['msg']}" for e in err.errors()
        )
        return JSONResponse(
            _error_body(400, problems or "invalid request", "invalid_request_error"), status_code=400
        )

    if api_key is not None:
        app.add_middleware(_ApiKeyGuard, api_key=api_key)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": model_name, **engine.stats()}

    @app.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": model_name,
            "object": "model",
            "created": server.created,
            "owned_by": "roll-pipeline",
            "max_model_len": engine.context_length,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        server.check_model(body.model)
        _refuse_unsupported(body)
        messages = [{"role": m.role, "content": _message_text(m)} for m in body.messages]
        try:
            prompt = engine.chat_prompt(messages)
        except ValueError as err:
            raise APIError(400, str(err), param="messages") from None
        except Exception as err:  # a chat template that rejects the conversation (roles out of order, ...)
            raise APIError(
                400, f"the chat template cannot render these messages: {err}", param="messages"
            ) from None
        params = server.params(body, [prompt], body.max_completion_tokens or body.max_tokens)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        envelope = functools.partial(_envelope, request_id, int(time.time()), model_name)
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))

            def chunk(index: int, text: str, finish: str | None, opening: bool) -> dict:
                delta = (
                    {"role": "assistant", "content": ""} if opening else ({"content": text} if text else {})
                )
                choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
                return envelope("chat.completion.chunk", [choice])

            def usage_chunk(usage: dict) -> dict:
                return envelope("chat.completion.chunk", [], usage)

            return StreamingResponse(
                server.stream(
                    request_id, [prompt], params, chunk, usage_chunk if include_usage else None, True
                ),
                media_type="text/event-stream",
            )
        choices = await server.wait(request, request_id, [prompt], params)
        message = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": None,
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ]
        return envelope("chat.completion", message, _usage([prompt], choices))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        server.check_model(body.model)
        _refuse_unsupported(body)
        prompts = _completion_prompts(body.prompt, engine)
        params = server.params(body, prompts, body.max_tokens)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        envelope = functools.partial(_envelope, request_id, int(time.time()), model_name)
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))

            def chunk(index: int, text: str, finish: str | None, _: bool) -> dict:
                choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
                return envelope("text_completion", [choice])

            def usage_chunk(usage: dict) -> dict:
                return envelope("text_completion", [], usage)

            return StreamingResponse(
                server.stream(
                    request_id, prompts, params, chunk, usage_chunk if include_usage else None, False
                ),
                media_type="text/event-stream",
            )
        choices = await server.wait(request, request_id, prompts, params)
        texts = [
            {"index": c.index, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
            for c in choices
        ]
        return envelope("text_completion", texts, _usage(prompts, choices))

    return app


def _completion_prompts(prompt: str | list, engine: Engine) -> list[list[int]]:
    if isinstance(prompt, str):
        texts: list[str] | None = [prompt]
    elif prompt and all(isinstance(p, str) for p in prompt):
        texts = list(prompt)
    else:
        texts = None
    if texts is not None:
        ids = [engine.text_prompt(t) for t in texts]
    elif prompt and all(isinstance(p, int) for p in prompt):
        ids = [list(prompt)]
    elif prompt and all(isinstance(p, list) for p in prompt):
        ids = [list(p) for p in prompt]
    else:
        raise APIError(400, "prompt must be a string, a list of strings, or token ids", param="prompt")
    if any(not p for p in ids):
        raise APIError(400, "a prompt has no tokens", param="prompt")
    vocab = len(engine.tokenizer)
    if any(not 0 <= t < vocab for p in ids for t in p):
        raise APIError(400, f"token ids must be in [0, {vocab})", param="prompt")
    return ids
