"""Tool standards: the registry of tool-call formats (each parses its own syntax: one
call, several, broken JSON, a cut call), the tokenizer's own ``response_template``, the
format named in the pipeline (an unknown one is one line at validation), and the tools'
JSON schemas rendered into the prompts through the chat template's ``tools=``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from rlhfflow.config.loader import load_pipeline
from rlhfflow.config.spec import SpecError
from rlhfflow.data.records import prompt_token_ids
from rlhfflow.data.source import PromptSource
from rlhfflow.engine.environments import ToolEnvironment
from rlhfflow.engine.models import (
    DEFAULT_ALPHABET,
    build_char_tokenizer,
    build_tiny_model,
    save_model,
)
from rlhfflow.engine.toolformats import (
    TOOL_FORMATS,
    CallError,
    Hermes,
    Llama3Json,
    Qwen3Coder,
    ResponseTemplate,
    ToolCall,
    ToolFormat,
    openai_tool_calls,
    register_tool_format,
    tool_format,
)
from tests.conftest import CHAT_TEMPLATE, chat_batch, chat_store, chat_tokenizer

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "multiturn"
ADD_SCHEMA = {"type": "function", "function": {
    "name": "add", "description": "Add two numbers.",
    "parameters": {"type": "object", "properties": {
        "a": {"type": "number", "description": "the first"},
        "b": {"type": "number", "description": "the second"}}, "required": ["a", "b"]}}}
ECHO_SCHEMA = {"type": "function", "function": {
    "name": "echo", "description": "Echo a text.",
    "parameters": {"type": "object", "properties": {"text": {"type": "string"}}}}}


# --------------------------------------------------------------------------- the formats


@pytest.mark.parametrize("text, expected", [
    ('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>',
     [ToolCall("add", {"a": 2, "b": 3})]),
    ('first <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> then '
     '<tool_call>{"name": "neg", "arguments": {"x": 4}}</tool_call>',
     [ToolCall("add", {"a": 1, "b": 2}), ToolCall("neg", {"x": 4})]),
    ('<tool_call>{"name": "add", "arguments": {"a": 2</tool_call>',
     [CallError("json", "the tool call is not JSON: Expecting ',' delimiter")]),
    ('<tool_call>["add"]</tool_call>',
     [CallError("json", 'expected {"name": "...", "arguments": {...}}')]),
    ('<tool_call>{"name": "add", "argu', [CallError("cut", "a <tool_call> without </tool_call>")]),
    ("the answer is 5", []),
])
def test_hermes_parses_its_calls_in_order(text, expected):
    assert Hermes().parse(text) == expected
    assert Hermes.stop == "</tool_call>"


QWEN_ADD = ("<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n<parameter=b>\n"
            "3.5\n</parameter>\n</function>\n</tool_call>")


@pytest.mark.parametrize("text, expected", [
    (QWEN_ADD, [ToolCall("add", {"a": 2, "b": 3.5})]),
    ("I add, then echo.\n" + QWEN_ADD + "\n<tool_call>\n<function=echo>\n<parameter=text>\n"
     "42\n</parameter>\n</function>\n</tool_call>",
     # echo's schema says text is a string: "42" stays text; add's numbers are read
     [ToolCall("add", {"a": 2, "b": 3.5}), ToolCall("echo", {"text": "42"})]),
    ("<tool_call>\n<parameter=a>\n2\n</parameter>\n</tool_call>",
     [CallError("json", "expected <function=NAME> ... </function> inside <tool_call>")]),
    (QWEN_ADD + "\n<tool_call>\n<function=echo>\n<parameter=te",
     [ToolCall("add", {"a": 2, "b": 3.5}),
      CallError("cut", "a <tool_call> without </tool_call>")]),
    ("no call here", []),
])
def test_qwen3_coder_parses_its_xml_calls_typed_by_the_tools_schemas(text, expected):
    assert Qwen3Coder().parse(text, [ADD_SCHEMA, ECHO_SCHEMA]) == expected
    assert Qwen3Coder.stop == "</tool_call>"


@pytest.mark.parametrize("text, expected", [
    ('{"name": "add", "parameters": {"a": 2, "b": 3}}', [ToolCall("add", {"a": 2, "b": 3})]),
    ('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
     '{"name": "neg", "arguments": {"x": 4}}',
     [ToolCall("add", {"a": 1, "b": 2}), ToolCall("neg", {"x": 4})]),
    ('{"name": "add", "parameters": {"a": 2} "b"}',
     [CallError("json", "the tool call is not JSON: Expecting ',' delimiter")]),
    ('{"name": "add", "parameters": {"a": 2, "b"', [CallError("cut", "a tool call cut before "
                                                                   "its end")]),
    ("The answer is 5.", []),
])
def test_llama3_json_parses_the_turn_as_its_calls(text, expected):
    assert Llama3Json().parse(text) == expected
    assert Llama3Json.stop is None


# Qwen 2.5's tool-call parsing as transformers ships it for Qwen models
# (transformers/cli/serving/utils.py), as a tokenizer's own response_template
QWEN_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {"open_pattern": r"\s*<tool_call>", "close": "</tool_call>",
                       "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"\s*(?:<\|im_end\|>|<\|endoftext\|>)",
                    "content": "text"},
    },
}


def test_auto_takes_the_tokenizer_s_response_template_else_hermes():
    tok = build_char_tokenizer()
    assert type(tool_format("auto", tok)) is Hermes
    tok.response_template = QWEN_RESPONSE_TEMPLATE
    fmt = tool_format("auto", tok)
    assert isinstance(fmt, ResponseTemplate) and fmt.stop == "</tool_call>"
    assert fmt.parse('I add.\n<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}'
                     '</tool_call>\n<tool_call>{"name": "neg", "arguments": {"x": 1}}'
                     '</tool_call>') == [ToolCall("add", {"a": 2, "b": 3}),
                                         ToolCall("neg", {"x": 1})]
    assert fmt.parse("the answer") == []
    [error] = fmt.parse('<tool_call>{"name": "add", "arguments": {</tool_call>')
    assert error.kind == "json" and error.message.startswith("the tool call does not parse: ")


def test_a_registered_format_is_found_by_name_and_a_name_is_taken_once():
    @register_tool_format("test_bang")
    class Bang(ToolFormat):
        """``!name`` calls ``name()``."""

        stop = None

        def parse(self, text, tools=()):
            return [ToolCall(word[1:], {}) for word in text.split() if word.startswith("!")]

    try:
        assert isinstance(tool_format("test_bang"), Bang)
        with pytest.raises(ValueError, match="already registered"):
            register_tool_format("test_bang")(type("Other", (ToolFormat,), {}))
    finally:
        del TOOL_FORMATS["test_bang"]


def test_openai_tool_calls_of_a_completion():
    calls, errors = openai_tool_calls(
        Qwen3Coder(), QWEN_ADD + "<tool_call>\n<function=add>", [ADD_SCHEMA])
    assert calls == [{"id": "call_0", "type": "function",
                      "function": {"name": "add", "arguments": '{"a": 2, "b": 3.5}'}}]
    assert errors == [CallError("cut", "a <tool_call> without </tool_call>")]


def _add(a: float, b: float) -> float:
    """Add two numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def test_a_tool_environment_runs_the_calls_of_its_format():
    env = ToolEnvironment({"add": _add}, timeout_s=5, isolation="thread",
                          tool_format=Qwen3Coder())
    text = QWEN_ADD + "\n<tool_call>\n<function=sub>\n</function>\n</tool_call>\n<tool_call>"
    assert env.step(text) == (
        [{"content": "5.5"}, {"content": "error: unknown tool 'sub' (known: add)"},
         {"content": "error: a <tool_call> without </tool_call>"}], 0.0, False,
        {"calls": 3, "errors": 2, "errors_unknown_tool": 1, "errors_cut": 1})
    assert env.step("5.5") == ([], 0.0, True, {"calls": 0, "errors": 0})


# --------------------------------------------------------------------------- end to end

LLAMA_CALL = '{"name": "add", "parameters": {"a": 2, "b": 3}}'


@pytest.fixture(scope="module")
def llama_tool_lm_dir(tmp_path_factory) -> Path:
    """A tiny Llama taught to answer a chat prompt with ``LLAMA_CALL`` and end its turn
    (``<|im_end|>``), as Llama 3 writes a JSON tool call."""
    from tests.stages.test_rollout import TEXTS, teach

    tok = build_char_tokenizer(DEFAULT_ALPHABET + '{}"')
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHAT_TEMPLATE
    model = build_tiny_model(tok, "lm", seed=0, max_positions=256)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    model.generation_config.eos_token_id = [tok.eos_token_id, end]
    prompt = tok.apply_chat_template([{"role": "user", "content": TEXTS[0]}],
                                     add_generation_prompt=True, tokenize=False)
    start = len(prompt_token_ids(tok, prompt, templated=True))
    ids = prompt_token_ids(tok, prompt + LLAMA_CALL, templated=True) + [end]
    teach(model, torch.tensor([ids]), start)
    path = tmp_path_factory.mktemp("models") / "llama-tool-lm"
    save_model(model, tok, path)
    return path


@pytest.mark.parametrize("fmt, turns", [("llama3_json", 2), ("hermes", 1)])
def test_a_rollout_runs_the_tool_calls_of_its_tool_format(llama_tool_lm_dir, fmt, turns):
    from tests.stages.test_rollout import TEXTS, _rollout

    store = chat_store(llama_tool_lm_dir)
    tok = store.get("actor").tokenizer
    batch = chat_batch(tok, TEXTS[:1], samples=2)
    out = _rollout(store, batch, tools=[str(EXAMPLE / "tools.py") + ":add"], greedy=True,
                   max_turns=2, max_new_tokens=60, max_tokens=160, tool_format=fmt)
    assert out["turns"].tolist() == [turns, turns]
    for row in range(2):
        text = tok.decode(out["response_ids"][row].tolist(), skip_special_tokens=True)
        # Hermes reads no call in Llama's JSON: the episode ends with the model's turn
        assert text.startswith(LLAMA_CALL + ("tool: 5assistant: " if turns == 2 else "")), \
            text
        if turns == 1:
            assert text == LLAMA_CALL


# --------------------------------------------------------------------------- the prompt

# Qwen 2.5's template (Hermes tool calls), its newlines as spaces (the character
# tokenizer has none): the tools' schemas in <tools></tools> of the system prompt.
QWEN_TEMPLATE = (
    "{%- if tools %}<|im_start|>system: "
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
    "{%- else %}You are a helpful assistant.{%- endif %}"
    " # Tools You may call one or more functions to assist with the user query. You are "
    "provided with function signatures within <tools></tools> XML tags: <tools>"
    "{%- for tool in tools %} {{ tool | tojson }}{%- endfor %} </tools> For each function "
    "call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags.<|im_end|>"
    "{%- elif messages[0]['role'] == 'system' %}<|im_start|>system: "
    "{{ messages[0]['content'] }}<|im_end|>{%- endif %}"
    "{%- for m in messages %}{%- if m['role'] != 'system' %}<|im_start|>"
    "{%- if m['role'] == 'tool' %}user: <tool_response> {{ m['content'] }} </tool_response>"
    "{%- else %}{{ m['role'] }}: {{ m['content'] }}{%- endif %}<|im_end|>{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant: {% endif %}")


@pytest.fixture(scope="module")
def template_models(tmp_path_factory) -> dict[str, Path]:
    """Tiny models whose template shows tools (Qwen 2.5's) or does not (``plain``)."""
    root = tmp_path_factory.mktemp("tool-templates")
    paths = {}
    for name, template in {"qwen": QWEN_TEMPLATE, "plain": CHAT_TEMPLATE}.items():
        tok = chat_tokenizer()
        tok.chat_template = template
        paths[name] = root / name
        save_model(build_tiny_model(tok, "lm", seed=0, max_positions=1024), tok, paths[name])
    return paths


def _pipeline(tmp_path: Path, model: Path, **params) -> Path:
    (tmp_path / "tools.py").write_text((EXAMPLE / "tools.py").read_text())
    data = yaml.safe_load((EXAMPLE / "guess-tiny.yaml").read_text())
    data["data"].update(prompts=str(EXAMPLE / "prompts.jsonl"), chat_template=True,
                        max_prompt_tokens=900)
    data["models"]["actor"] = {"path": str(model), "trainable": True}
    rollout = data["stages"]["rollout"]["params"]
    del rollout["env"], rollout["env_kwargs"]
    rollout.update(tools=["tools.py:add"], **params)
    path = tmp_path / "tools.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _prompts(path: Path) -> tuple[list[str], list[str]]:
    """The prompts the data source renders, and those the template renders without tools."""
    pipeline = load_pipeline(path)
    source = PromptSource.from_pipeline(pipeline, "actor")
    records = [json.loads(line) for line in (EXAMPLE / "prompts.jsonl").read_text().splitlines()
               if line.strip()]
    bare = [source.tokenizer.apply_chat_template(
        [{"role": "user", "content": r["prompt"]}], add_generation_prompt=True, tokenize=False)
        for r in records]
    return source.texts, bare


def test_the_prompts_show_the_tools_schemas_where_the_template_shows_tools(
        tmp_path, template_models):
    from transformers.utils import get_json_schema

    from tests.conftest import example_module

    schema = json.dumps(get_json_schema(example_module("multiturn", "tools").add))
    texts, bare = _prompts(_pipeline(tmp_path, template_models["qwen"]))
    assert all(f"<tools> {schema} </tools>" in text for text in texts), texts[0]
    # the system prompt with the tools, then the prompt as it was
    assert all(text.startswith("<|im_start|>system: ") and text.endswith(b)
               for text, b in zip(texts, bare, strict=True))
    # off: the prompts are as the template renders them without tools
    texts, bare = _prompts(_pipeline(tmp_path, template_models["qwen"], tools_in_prompt=False))
    assert texts == bare


def test_the_prompts_are_unchanged_where_the_template_shows_no_tools(tmp_path,
                                                                      template_models):
    texts, bare = _prompts(_pipeline(tmp_path, template_models["plain"]))
    assert texts == bare and "add" not in texts[0]


def test_tools_in_prompt_true_without_a_template_that_shows_tools_is_one_line(
        tmp_path, template_models):
    path = _pipeline(tmp_path, template_models["plain"], tools_in_prompt=True)
    with pytest.raises(SpecError) as info:
        load_pipeline(path)
    assert str(info.value) == (
        f"{path}: stages.rollout.params.tools_in_prompt: true, but the model's chat "
        "template shows no tools (its rendering does not change with tools=); set it to "
        "auto or false and describe the tools in the prompts")


def test_a_tool_format_by_import_path_must_be_a_tool_format(tmp_path, template_models):
    (tmp_path / "formats.py").write_text(
        "from rlhfflow.engine.toolformats import Hermes\n\n\n"
        "class Mine(Hermes):\n    pass\n\n\nclass NotOne:\n    pass\n")
    load_pipeline(_pipeline(tmp_path, template_models["qwen"], tool_format="formats.py:Mine"))
    path = _pipeline(tmp_path, template_models["qwen"], tool_format="formats.py:NotOne")
    with pytest.raises(SpecError) as info:
        load_pipeline(path)
    assert str(info.value) == (f"{path}: stages.rollout.params.tool_format: 'formats.py:NotOne' "
                               "is not a ToolFormat subclass (rlhfflow.engine.toolformats)")


def test_an_unknown_tool_format_is_one_line_at_validate(tmp_path, template_models):
    path = _pipeline(tmp_path, template_models["qwen"], tool_format="hermez")
    done = subprocess.run([sys.executable, "-m", "rlhfflow.cli.main", "validate", str(path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"Error: {path}: stages.rollout.params.tool_format: unknown tool format 'hermez'; "
        "did you mean 'hermes'?; known: auto, hermes, llama3_json, qwen3_coder (or an import "
        "path 'file.py:Class' of a ToolFormat subclass)"]
