"""A domain whose environment describes its tools (the python tool with `call_format: hermes`) renders them into
its prompts through the chat template's tools support; a template without it is an error before the run starts."""

from __future__ import annotations

import shutil

import pytest

from roll_core.data.loading import DataError, fit_prompts
from roll_pipeline.driver.names import domain_tools, load_run_config
from tests.conftest import EXAMPLES
from workers.environments.python_tool import PythonToolEnvironment
from workers.environments.tool_calls import TOOL_DESCRIPTION

HERMES = "rewards.tool_math.rollout.environment_options={timeout_s: 5, call_format: hermes}"

# A template of the Hermes kind (Qwen2.5's is one): with tools, a system message lists them as JSON and says how
# to call one; without, the plain ChatML of the embedded models. Written for this test.
TOOLS_TEMPLATE = """\
{%- if tools %}<|im_start|>system
Tools you may call:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call one as <tool_call>
{"name": NAME, "arguments": ARGUMENTS}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
{%- endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"""


@pytest.fixture
def tools_tokenizer(tmp_path):
    """tiny-qwen2-tool's tokenizer with a template that renders tools."""
    from transformers import AutoTokenizer

    folder = tmp_path / "tokenizer"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(EXAMPLES / "models" / "tiny-qwen2-tool" / name, folder / name)
    (folder / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    return AutoTokenizer.from_pretrained(folder)


def test_the_python_tool_is_described_only_in_the_format_that_templates_describe():
    assert PythonToolEnvironment(call_format="hermes").tools() == [TOOL_DESCRIPTION]
    assert PythonToolEnvironment().tools() is None  # plain: the embedded models were taught the call
    assert TOOL_DESCRIPTION["function"]["name"] == "python"
    assert TOOL_DESCRIPTION["function"]["parameters"]["required"] == ["code"]


def test_domain_tools_come_from_each_multi_turn_domains_environment():
    config = EXAMPLES / "tool_math.yaml"
    assert domain_tools(load_run_config(config, [HERMES]).config) == {"tool_math": [TOOL_DESCRIPTION]}
    assert domain_tools(load_run_config(config, []).config) == {}
    assert domain_tools(load_run_config(config, ["rewards.tool_math.rollout=single_turn"]).config) == {}


def test_a_described_domain_renders_its_tools_into_every_prompt_and_the_others_do_not(tools_tokenizer):
    from roll_pipeline.driver.runtime import load_run_data

    cfg = load_run_config(EXAMPLES / "tool_math.yaml", [HERMES, "data.prompt_length=512"]).config
    data = load_run_data(tools_tokenizer, cfg)
    for split in (data.train, data.val):
        ids = split["tool_math"].prompt_ids
        first = tools_tokenizer.decode(ids[0])
        assert first.startswith("<|im_start|>system\nTools you may call:\n<tools>\n{")
        assert '"name": "python"' in first and first.endswith("<|im_start|>assistant\n")
        assert all(tools_tokenizer.decode(p).count("<tools>") == 1 for p in ids)
    plain = load_run_data(tools_tokenizer, load_run_config(EXAMPLES / "tool_math.yaml", []).config)
    assert tools_tokenizer.decode(plain.train["tool_math"].prompt_ids[0]).startswith("<|im_start|>user\n")
    # the same row, with and without the tools described: only the system message differs
    described, bare = data.train["tool_math"], plain.train["tool_math"]
    assert described.rows[0]["id"] == bare.rows[0]["id"]
    assert described.prompt_ids[0][-len(bare.prompt_ids[0]):] == bare.prompt_ids[0]


def test_a_template_without_tools_support_is_an_error_naming_the_domain():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(EXAMPLES / "models" / "tiny-qwen2-tool")
    routed = {"tool_math": [{"messages": [{"role": "user", "content": "What is 123 * 456?"}], "_source": "f:1"}]}
    data = load_run_config(EXAMPLES / "tool_math.yaml", []).config.data
    with pytest.raises(DataError, match=r"rewards.tool_math.rollout: the environment describes its tools \('python'\)"
                       r" for the prompt, but the chat template of .*tiny-qwen2-tool does not render tools"):
        fit_prompts(tokenizer, routed, data, "train", tools={"tool_math": [TOOL_DESCRIPTION]})
    assert fit_prompts(tokenizer, routed, data, "train")["tool_math"].prompt_ids  # nothing described: fine


@pytest.mark.slow
def test_the_dry_run_refuses_a_described_tool_the_models_template_cannot_render():
    from roll_pipeline.driver.preflight import preflight

    checks = preflight(load_run_config(EXAMPLES / "tool_math.yaml", [HERMES]), dry_run=True)
    failed = {c.name: c.detail for c in checks if not c.ok}
    assert set(failed) == {"data.train_files", "data.val_files"}, failed
    assert "call_format: plain" in failed["data.train_files"]
    assert all(c.ok for c in preflight(load_run_config(EXAMPLES / "tool_math.yaml", []), dry_run=True))
