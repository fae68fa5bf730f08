"""`roll serve`: what MODEL_PATH resolves to, the batching engine in-process, and a real `roll serve` process
on 127.0.0.1 driven with the official `openai` client (chat and completions, streaming and not, errors,
batching of concurrent requests, a client that gives up)."""

from __future__ import annotations

import json
import shutil
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import requests
import torch

from roll_pipeline.driver.cli import main
from roll_pipeline.serve.commands import vllm_command
from tests.conftest import TINY_MODEL, wait_for
from tests.judge_servers import ServeProcess
from workers.inference.engine import Engine, SamplingParams
from workers.inference.model_path import ModelPathError, ServedModel, resolve_model_path

MATH = [{"role": "user", "content": "What is 12 + 45?"}]
CODE = [{"role": "user", "content": "Write a Python function `f(x)` that returns x plus 3."}]


# --- MODEL_PATH ---------------------------------------------------------------------------------------------


def _checkpoint_run(tmp_path: Path, tokenizer_from: Path) -> Path:
    """A run's output folder as the pipeline writes it: checkpoints/step_N/actor_train/hf_model without a
    tokenizer, checkpoints/latest, and resolved_config.json naming where the run started."""
    run = tmp_path / "runs" / "exp"
    for step in (2, 4):
        hf_model = run / "checkpoints" / f"step_{step}" / "actor_train" / "hf_model"
        hf_model.mkdir(parents=True)
        for name in ("config.json", "generation_config.json", "model.safetensors"):
            shutil.copy(TINY_MODEL / name, hf_model / name)
        (hf_model.parent / "mp_rank_00_model_states.pt").write_bytes(b"deepspeed")
    (run / "checkpoints" / "latest").write_text("step_4")
    config = {
        "config": {
            "pretrain": str(tokenizer_from),
            "actor_train": {"model_args": {"model_name_or_path": str(tokenizer_from)}},
        }
    }
    (run / "resolved_config.json").write_text(json.dumps(config))
    return run


def test_a_hugging_face_folder_is_served_as_it_is(tiny_model):
    assert resolve_model_path(tiny_model) == ServedModel(tiny_model, tiny_model)


def test_every_level_of_a_checkpoint_resolves_to_its_hf_model_and_the_runs_tokenizer(tiny_model, tmp_path):
    run = _checkpoint_run(tmp_path, tiny_model)
    latest = run / "checkpoints" / "step_4" / "actor_train" / "hf_model"
    for path in (
        run,
        run / "checkpoints",
        run / "checkpoints" / "step_4",
        run / "checkpoints" / "step_4" / "actor_train",
        latest,
    ):
        assert resolve_model_path(path) == ServedModel(latest, tiny_model), path
    older = run / "checkpoints" / "step_2"
    assert resolve_model_path(older).weights == older / "actor_train" / "hf_model"
    assert resolve_model_path(latest, tokenizer=tiny_model).tokenizer == tiny_model


def test_model_path_errors_say_what_is_missing(tiny_model, tmp_path):
    with pytest.raises(ModelPathError, match="does not exist"):
        resolve_model_path(tmp_path / "nope")
    run = _checkpoint_run(tmp_path, tmp_path)  # the run "started" from a folder without a tokenizer
    with pytest.raises(ModelPathError, match="has no tokenizer.*--tokenizer"):
        resolve_model_path(run)
    shutil.rmtree(run / "checkpoints" / "step_2" / "actor_train" / "hf_model")
    with pytest.raises(ModelPathError, match="without hf_model"):
        resolve_model_path(run / "checkpoints" / "step_2")
    with pytest.raises(ModelPathError, match="holds no model"):
        resolve_model_path(tmp_path)
    with pytest.raises(ModelPathError, match="holds no tokenizer"):
        resolve_model_path(tiny_model, tokenizer=tmp_path)


def _adapter_folder(tiny_model: Path, folder: Path):
    """A LoRA adapter on the tiny model, as peft saves it (its config names the base), with drawn B matrices so
    that it changes the model; returns the adapted model, unmerged."""
    from transformers import AutoModelForCausalLM

    from roll_core.config.clusters import LoraArgs
    from workers.strategies.lora import with_lora

    model = with_lora(AutoModelForCausalLM.from_pretrained(tiny_model), LoraArgs(rank=4, alpha=8.0)).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(0.3 * torch.randn(parameter.shape, generator=generator))
    model.save_pretrained(folder)
    return model


def test_a_lora_adapter_folder_is_served_on_its_base(tiny_model, tmp_path):
    adapted = _adapter_folder(tiny_model, tmp_path / "adapter")
    assert resolve_model_path(tmp_path / "adapter") == ServedModel(tiny_model, tiny_model, tmp_path / "adapter")
    engine = Engine(resolve_model_path(tmp_path / "adapter"))
    ids = torch.tensor([engine.chat_prompt(MATH)])
    with torch.no_grad():
        served, expected = engine.strategy.model(ids).logits, adapted(ids).logits
        base = Engine(resolve_model_path(tiny_model)).strategy.model(ids).logits
    assert float((served - expected).abs().max()) < 1e-4  # base + adapter (merged once at load)
    assert float((base - expected).abs().max()) > 1e-2  # and not the base alone
    command = vllm_command(resolve_model_path(tmp_path / "adapter"), name="mine", host="h", port=1, dtype=None, extra=[])
    assert command[command.index("--served-model-name") + 1] == "mine-base"
    assert command[command.index("--lora-modules") + 1] == f"mine={tmp_path / 'adapter'}"
    assert command[command.index("--max-lora-rank") + 1] == "8" and "--enable-lora" in command


def test_an_adapter_whose_base_is_not_here_names_the_base_flag(tiny_model, tmp_path):
    _adapter_folder(tiny_model, tmp_path / "adapter")
    config = tmp_path / "adapter" / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "base_model_name_or_path": "/gone"}))
    with pytest.raises(ModelPathError, match="base model /gone is not a model folder here: name the base with --base"):
        resolve_model_path(tmp_path / "adapter")
    assert resolve_model_path(tmp_path / "adapter", base=tiny_model).weights == tiny_model
    with pytest.raises(ModelPathError, match="--base is for a LoRA adapter folder"):
        resolve_model_path(tiny_model, base=tiny_model)


def test_vllm_engine_command_and_a_clear_error_without_vllm(tiny_model, capsys, monkeypatch):
    served = ServedModel(Path("/ckpt/hf_model"), Path("/base"))
    command = vllm_command(
        served, name="judge", host="127.0.0.1", port=8011, dtype=None, extra=["--max-model-len=4096"]
    )
    assert command[1:] == [
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "/ckpt/hf_model",
        "--tokenizer",
        "/base",
        "--served-model-name",
        "judge",
        "--host",
        "127.0.0.1",
        "--port",
        "8011",
        "--dtype",
        "auto",
        "--max-model-len=4096",
    ]
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    assert main(["serve", str(tiny_model), "--engine", "vllm"]) == 2
    assert "--engine vllm needs the vllm package" in capsys.readouterr().err


def test_serve_refuses_a_missing_api_key_variable(tiny_model, capsys, monkeypatch):
    monkeypatch.delenv("ROLL_TEST_NO_SUCH_KEY", raising=False)
    assert main(["serve", str(tiny_model), "--api-key-env", "ROLL_TEST_NO_SUCH_KEY"]) == 2
    assert "ROLL_TEST_NO_SUCH_KEY" in capsys.readouterr().err


# --- the engine, in-process ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine() -> Engine:
    torch.set_num_threads(1)
    return Engine(resolve_model_path(TINY_MODEL), max_batch_sequences=16)


def _greedy_reference(engine: Engine, prompt: list[int], max_new_tokens: int) -> str:
    """The same model's greedy continuation with plain `generate`, to check the engine against."""
    model = engine.strategy.model
    ids = torch.tensor([prompt])
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=sorted(engine.eos_ids),
        pad_token_id=engine.strategy.pad_id,
    )
    return engine.decode(out[0, len(prompt) :].tolist())


def test_engine_greedy_matches_plain_generate_and_streams_the_same_text(engine):
    prompts = [engine.chat_prompt(MATH), engine.chat_prompt(CODE)]
    deltas: dict[int, list[str]] = {0: [], 1: []}
    finishes: dict[int, str] = {}

    def on_delta(index: int, text: str, finish: str | None) -> None:
        deltas[index].append(text)
        if finish is not None:
            finishes[index] = finish

    choices = engine.submit(
        "greedy", prompts, SamplingParams(max_tokens=40, temperature=0), on_delta
    ).result()
    for prompt, choice in zip(prompts, choices, strict=True):
        assert choice.text == _greedy_reference(engine, prompt, 40)
        assert "".join(deltas[choice.index]) == choice.text
        assert finishes[choice.index] == choice.finish_reason == "stop"
    assert sum(len(d) for d in deltas.values()) > 4, "text arrives in pieces, not at the end"


def test_engine_joins_concurrent_requests_with_their_own_budgets_and_stops(engine):
    before = engine.batcher.batches_run
    prompt = engine.chat_prompt(CODE)
    full = _greedy_reference(engine, prompt, 40)
    params = [
        SamplingParams(max_tokens=3, temperature=0),
        SamplingParams(max_tokens=40, temperature=0),
        SamplingParams(max_tokens=40, temperature=0, stop=("return",)),
        SamplingParams(max_tokens=40, temperature=0, n=2),
    ]
    # Submitted while the batcher's queue is held: all four are waiting when it looks (no race with its gather
    # window, which a preempted thread could otherwise miss).
    with engine.batcher._cond:
        futures = [engine.submit(f"join-{i}", [prompt], p) for i, p in enumerate(params)]
    short, long, stopped, twice = (f.result() for f in futures)
    assert engine.batcher.batches_run - before == 1, "the four requests ran as one batch"
    assert engine.batcher.sizes[-1] == 5
    assert short[0].finish_reason == "length" and short[0].tokens == 3 and full.startswith(short[0].text)
    assert long[0].text == full
    assert stopped[0].finish_reason == "stop" and stopped[0].text == full[: full.index("return")]
    assert [c.text for c in twice] == [full, full]


def test_engine_sampling_gives_n_samples_and_an_abort_returns_none(engine):
    prompt = engine.chat_prompt(MATH)
    samples = engine.submit("sample", [prompt], SamplingParams(max_tokens=8, temperature=1.0, n=6)).result()
    assert [c.index for c in samples] == list(range(6))
    with engine.batcher.generation_lock:  # hold the batch back so that the request is still pending
        future = engine.submit("to-abort", [prompt], SamplingParams(max_tokens=8, temperature=0))
        time.sleep(0.1)
        engine.abort("to-abort")
    assert future.result(timeout=30) is None
    assert engine.stats()["aborted"] >= 1


# --- a real `roll serve` process and the openai client ------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_model):
    process = ServeProcess(tiny_model, "tiny", extra=("--max-batch-size", "32")).start()
    yield process
    process.stop()


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


@pytest.mark.slow
def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    health = server.health()
    assert health["status"] == "ok" and health["model"] == "tiny"


@pytest.mark.slow
def test_chat_completion_with_the_openai_client(client):
    reply = client.chat.completions.create(model="tiny", messages=MATH, temperature=0, max_tokens=16)
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason == "stop"
    assert choice.message.content.strip().isdigit(), choice.message.content
    assert reply.usage.completion_tokens >= 1
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    sampled = client.chat.completions.create(model="tiny", messages=MATH, temperature=1.0, n=4, max_tokens=8)
    assert [c.index for c in sampled.choices] == [0, 1, 2, 3]


@pytest.mark.slow
def test_chat_streaming_gives_the_same_text_in_pieces(client):
    whole = client.chat.completions.create(model="tiny", messages=CODE, temperature=0, max_tokens=40)
    stream = client.chat.completions.create(
        model="tiny",
        messages=CODE,
        temperature=0,
        max_tokens=40,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len(pieces) > 3
    assert "".join(pieces) == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


@pytest.mark.slow
def test_completions_streaming_and_not(client):
    prompt = "def f(x):\n    return"
    whole = client.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=12)
    assert whole.object == "text_completion" and whole.choices[0].finish_reason in ("stop", "length")
    pieces = [
        c.choices[0].text
        for c in client.completions.create(
            model="tiny", prompt=prompt, temperature=0, max_tokens=12, stream=True
        )
        if c.choices
    ]
    assert "".join(pieces) == whole.choices[0].text
    several = client.completions.create(
        model="tiny", prompt=["What is 1 + 2?", prompt], temperature=0, max_tokens=12
    )
    assert [c.index for c in several.choices] == [0, 1]
    assert several.choices[1].text == whole.choices[0].text
    capped = client.completions.create(model="tiny", prompt=prompt, temperature=1.0, max_tokens=2)
    assert capped.usage.completion_tokens <= 2


@pytest.mark.slow
def test_errors_have_openai_shape(client, server):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4", messages=MATH)
    with pytest.raises(openai.BadRequestError, match="logprobs are not supported"):
        client.chat.completions.create(model="tiny", messages=MATH, logprobs=True)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model="tiny", prompt="word " * 400, max_tokens=4)
    raw = requests.post(f"{server.url}/chat/completions", json={"model": "tiny", "messages": []}, timeout=10)
    assert raw.status_code == 400 and "messages" in raw.json()["error"]["message"]


@pytest.mark.slow
def test_concurrent_requests_are_batched(client, server):
    """32 requests that wait together behind a long batch run as one batch (the server's --max-batch-size is 32)
    once it is gone: counted by events, not by how fast the clients happen to arrive."""
    base = server.url.rsplit("/v1", 1)[0]
    before = server.health()
    blocker = send_and_hold(
        base, "/v1/completions", {"model": "tiny", "prompt": ["x"] * 64, "temperature": 2.0, "max_tokens": 300}
    )
    try:
        wait_for(lambda: server.health()["requests"] - before["requests"] >= 1, "the blocking request's arrival")
        with ThreadPoolExecutor(32) as pool:
            futures = [
                pool.submit(
                    client.chat.completions.create, model="tiny", messages=MATH, temperature=1.0, max_tokens=8
                )
                for _ in range(32)
            ]
            wait_for(lambda: server.health()["requests"] - before["requests"] == 33, "32 requests behind the blocker")
            assert server.health()["completed"] == before["completed"], "the blocker ended before the test did"
            blocker.close()
            replies = [future.result() for future in futures]
    finally:
        blocker.close()
    after = server.health()
    assert len(replies) == 32 and all(reply.choices[0].message.content is not None for reply in replies)
    assert after["completed"] - before["completed"] == 32
    assert after["batches"] - before["batches"] == 2, "the blocker's batch, then all 32 requests in one"


def send_and_hold(url: str, path: str, body: dict) -> socket.socket:
    """POSTs `body` on a socket of its own and returns the socket without reading the reply: closing it is a client
    that gave up, at a moment the test chooses rather than at a timeout."""
    host, port = url.split("//")[1].split("/")[0].split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    sock.sendall(head.encode() + data)
    return sock


@pytest.mark.slow
def test_a_client_that_gives_up_aborts_its_request(server):
    """A long batch runs while three clients send a request and hang up: each is aborted in the engine (counted
    before the batch's own client hangs up too). Events, not a client timeout racing the batch's run time."""
    base = server.url.rsplit("/v1", 1)[0]
    start = server.health()
    blocker = send_and_hold(
        base, "/v1/completions", {"model": "tiny", "prompt": ["x"] * 64, "temperature": 2.0, "max_tokens": 300}
    )
    try:
        wait_for(lambda: server.health()["requests"] - start["requests"] >= 1, "the blocking request's arrival")
        for _ in range(3):  # queued behind the blocker, then gone
            send_and_hold(
                base, "/v1/completions", {"model": "tiny", "prompt": "y", "temperature": 2.0, "max_tokens": 200}
            ).close()
        wait_for(lambda: server.health()["aborted"] - start["aborted"] >= 3, "three aborts")
        health = server.health()
        assert health["aborted"] - start["aborted"] == 3
        assert health["completed"] == start["completed"], "nothing finished: the clients' requests never ran"
    finally:
        blocker.close()
    wait_for(lambda: server.health()["aborted"] - start["aborted"] == 4, "the blocker's abort")


@pytest.mark.slow
def test_an_api_key_is_required_when_set(tiny_model, monkeypatch):
    monkeypatch.setenv("ROLL_TEST_SERVE_KEY", "sk-serve")
    process = ServeProcess(tiny_model, "tiny", extra=("--api-key-env", "ROLL_TEST_SERVE_KEY")).start()
    try:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=process.url, api_key="wrong", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=process.url, api_key="sk-serve", max_retries=0)
        assert ok.models.list().data[0].id == "tiny"
        assert requests.get(f"http://127.0.0.1:{process.port}/health", timeout=5).ok
    finally:
        process.stop()


@pytest.mark.slow
def test_roll_serve_with_the_vllm_engine_answers_openai_requests(tiny_model, tmp_path):
    """`roll serve --engine vllm` on vLLM's CPU build (the dev venv's): vLLM's own server, driven with the openai
    client like the hf engine's."""
    import os
    import subprocess
    import sys

    from tests.judge_servers import free_port
    from tests.test_vllm_engine import require_vllm_cpu_build
    from workers.strategies.vllm_infer import vllm_build

    if vllm_build() == "cuda":
        pytest.skip("vLLM's CUDA build is installed (a venv holds one build or the other)")
    require_vllm_cpu_build()
    port, log = free_port(), tmp_path / "vllm-serve.log"
    command = [sys.executable, "-m", "roll_pipeline.driver.cli", "serve", str(tiny_model), "--engine", "vllm",
               "--port", str(port), "--served-model-name", "tiny", "--vllm-arg=--max-model-len=256", "--vllm-arg=--enforce-eager"]
    with log.open("w") as out:  # a file: vLLM logs more than a pipe holds while nobody reads it
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                  env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    try:
        def healthy() -> bool:
            assert server.poll() is None, f"roll serve --engine vllm exited:\n{log.read_text()[-4000:]}"
            try:
                return requests.get(f"http://127.0.0.1:{port}/health", timeout=2).ok
            except requests.RequestException:
                return False

        wait_for(healthy, "vLLM's server to answer /health", limit_s=300)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        assert [m.id for m in client.models.list().data] == ["tiny"]
        completion = client.completions.create(model="tiny", prompt="12+7=", max_tokens=8, temperature=0)
        assert completion.usage.completion_tokens >= 1
        chat = client.chat.completions.create(model="tiny", messages=MATH, max_tokens=16, temperature=0)
        assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
        assert "starting vLLM: " in log.read_text()
    finally:
        server.terminate()
        server.wait(timeout=60)
