"""The shipped chat templates and the renderer: exact prompts, HF options, errors a client would get."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from extproc.errors import BadRequest, ConfigError
from extproc.tokenize import (
    TEMPLATE_NAMES,
    ChatTemplate,
    ChatTemplateError,
    ChatTemplateLoadError,
    TemplateName,
    Tokenizer,
    is_template_name,
    render_chat,
    shipped_chat_template,
    shipped_template,
    shipped_tokenizer,
    tokenize_chat,
)

CHAT: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": [{"type": "text", "text": "Weather in"}, {"type": "text", "text": "Paris?"}]},
]
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
TOOL_JSON = (
    '{"type": "function", "function": {"name": "get_weather", "description": "Current weather.", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}'
)
TOOL_CHAT: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "18°C"},
    {"role": "assistant", "content": "18°C and sunny."},
]

EXPECTED_CHAT = {
    "llama3": "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nWeather in\nParis?<|eot_id|>",
    "chatml": "<|im_start|>system\nBe brief.<|im_end|>\n"
    "<|im_start|>user\nHi<|im_end|>\n"
    "<|im_start|>assistant\nHello!<|im_end|>\n"
    "<|im_start|>user\nWeather in\nParis?<|im_end|>\n",
}
GENERATION_PROMPT = {
    "llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "chatml": "<|im_start|>assistant\n",
}
EXPECTED_TOOLS = {
    "llama3": "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
    "You can call the functions below. To call one, answer with only a JSON object "
    '{"name": <function name>, "parameters": <arguments object>}.\n\n' + TOOL_JSON + "\n\n<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nWeather in Paris?<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
    '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    "<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n18°C<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n18°C and sunny.<|eot_id|>",
    "chatml": "<|im_start|>system\n# Tools\n\nYou may call one or more of these functions:\n<tools>\n"
    + TOOL_JSON
    + "\n</tools>\n\nFor each call, answer with a JSON object inside <tool_call></tool_call> tags:\n"
    '<tool_call>\n{"name": <function name>, "arguments": <arguments object>}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
    '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    "</tool_call><|im_end|>\n"
    "<|im_start|>user\n<tool_response>\n18°C\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n18°C and sunny.<|im_end|>\n",
}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return shipped_tokenizer()


def _render(name: TemplateName, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    return render_chat(shipped_tokenizer(), shipped_chat_template(name), messages, **kwargs)


@pytest.mark.parametrize("name", TEMPLATE_NAMES)
@pytest.mark.parametrize("add_generation_prompt", [True, False], ids=["gen-prompt", "no-gen-prompt"])
def test_system_multi_turn_and_content_parts(name: TemplateName, add_generation_prompt: bool) -> None:
    """System prompt, turns and text parts (joined by newline) render exactly; the prompt is optional."""
    expected = EXPECTED_CHAT[name] + (GENERATION_PROMPT[name] if add_generation_prompt else "")
    assert _render(name, CHAT, add_generation_prompt=add_generation_prompt) == expected


@pytest.mark.parametrize("name", TEMPLATE_NAMES)
def test_tools_tool_calls_and_tool_results(name: TemplateName) -> None:
    """Tools in the system block, assistant tool calls (arguments parsed) and tool results render exactly."""
    assert _render(name, TOOL_CHAT, tools=TOOLS, add_generation_prompt=False) == EXPECTED_TOOLS[name]


@pytest.mark.parametrize("name", TEMPLATE_NAMES)
def test_direct_render_matches_vllm_shaped_render(name: TemplateName, tok: Tokenizer) -> None:
    """Rendering raw request messages directly gives the same text as after vLLM-style shaping."""
    template = shipped_chat_template(name)
    direct = template.render(CHAT, bos_token=tok.bos_token, eos_token=tok.eos_token)
    assert direct == _render(name, CHAT)


@pytest.mark.parametrize(
    ("name", "kwargs", "expected_tail"),
    [
        ("chatml", {"enable_thinking": False}, "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
        ("chatml", {"enable_thinking": True}, "<|im_start|>assistant\n"),
        ("chatml", {"unused_by_template": 1}, "<|im_start|>assistant\n"),
    ],
    ids=["thinking-off", "thinking-on", "unused-kwarg"],
)
def test_chatml_kwargs_reach_template(name: TemplateName, kwargs: dict[str, Any], expected_tail: str) -> None:
    """chat_template_kwargs reach the template: ChatML reads enable_thinking."""
    text = _render(name, [{"role": "user", "content": "Hi"}], chat_template_kwargs=kwargs)
    assert text == "<|im_start|>user\nHi<|im_end|>\n" + expected_tail


def test_llama3_date_string_kwarg() -> None:
    """chat_template_kwargs reach the template: Llama-3 reads date_string into a system block."""
    text = _render(
        "llama3", [{"role": "user", "content": "Hi"}], chat_template_kwargs={"date_string": "1 Jan 2025"}
    )
    assert text.startswith(
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nToday Date: 1 Jan 2025\n\n<|eot_id|>"
    )


@pytest.mark.parametrize("name", TEMPLATE_NAMES)
@pytest.mark.parametrize(
    ("final", "kept"),
    [
        ("Sure, the answer is", "Sure, the answer is"),
        ("Trailing space ", "Trailing space "),
        ([{"type": "text", "text": "From"}, {"type": "text", "text": "parts"}], "From\nparts"),
    ],
    ids=["plain", "trailing-space", "content-parts"],
)
def test_continue_final_message(name: TemplateName, final: Any, kept: str) -> None:
    """continue_final_message ends the prompt right after the final assistant content."""
    messages = [{"role": "user", "content": "Go"}, {"role": "assistant", "content": final}]
    text = _render(name, messages, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith(GENERATION_PROMPT[name] + kept)
    full = _render(name, messages, add_generation_prompt=False)
    assert full.startswith(text) and len(full) > len(text)


@pytest.mark.parametrize(
    ("messages", "add_generation_prompt", "match"),
    [
        ([{"role": "user", "content": "Hi"}], False, "role 'assistant'"),
        (
            [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "A"}],
            True,
            "cannot both be true",
        ),
        ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}], False, "no text"),
    ],
    ids=["final-not-assistant", "with-generation-prompt", "no-content"],
)
def test_continue_final_message_errors(
    messages: list[dict[str, Any]], add_generation_prompt: bool, match: str
) -> None:
    """Misusing continue_final_message is a ChatTemplateError (400)."""
    template = shipped_chat_template("chatml")
    with pytest.raises(ChatTemplateError, match=match):
        template.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=True,
            bos_token=None,
            eos_token=None,
        )


@pytest.mark.parametrize("name", TEMPLATE_NAMES)
@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "conversation is empty"),
        ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], "only allowed as the first"),
        ([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}], "must follow an assistant"),
        ([{"role": "narrator", "content": "a"}], 'Unknown role "narrator"'),
        ([{"role": "user", "content": [{"type": "image", "url": "x"}]}], 'got type "image"'),
    ],
    ids=["empty", "late-system", "orphan-tool", "unknown-role", "image-part"],
)
def test_raise_exception_is_chat_template_error(
    name: TemplateName, messages: list[dict[str, Any]], match: str, tok: Tokenizer
) -> None:
    """Invalid conversations hit raise_exception, surfacing as a 400 naming the template."""
    template = shipped_chat_template(name)
    with pytest.raises(ChatTemplateError, match=match) as info:
        template.render(messages, bos_token=tok.bos_token, eos_token=tok.eos_token)
    assert isinstance(info.value, BadRequest) and info.value.status == 400
    assert f"{name}.jinja" in str(info.value)


@pytest.mark.parametrize(
    ("source", "match"),
    [
        ("{{ messages[0].missing.deeper }}", "UndefinedError"),
        ("{{ raise_exception('custom refusal') }}", "custom refusal"),
        ("{{ messages.__class__ }}{{ ''.__class__.__mro__ }}", "SecurityError|UndefinedError"),
        ("{{ messages[0].content + 1 }}", "TypeError"),
    ],
    ids=["undefined-attribute", "raise-exception", "sandbox", "type-error"],
)
def test_render_failures_are_400(source: str, match: str) -> None:
    """Any failure while rendering becomes a ChatTemplateError carrying the template's name."""
    with pytest.raises(ChatTemplateError, match=match) as info:
        ChatTemplate(source, name="custom").render(
            [{"role": "user", "content": "x"}], bos_token=None, eos_token=None
        )
    assert info.value.template == "custom"


def test_the_sandbox_answers_the_same_every_time() -> None:
    """Its attribute check is remembered per type and name: a mutation is refused on every
    render, not only the first, and a safe method keeps working."""
    mutate = ChatTemplate("{{ messages.append(1) }}{{ messages[0].content.upper() }}", name="m")
    safe = ChatTemplate("{% for m in messages %}{{ m.content.upper() }}{% endfor %}", name="s")
    messages = [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}]
    for _ in range(3):
        with pytest.raises(ChatTemplateError, match=r"SecurityError|Undefined|unsafe"):
            mutate.render(messages, bos_token=None, eos_token=None)
        assert safe.render(messages, bos_token=None, eos_token=None) == "XY"
    assert len(messages) == 2


@pytest.mark.parametrize("key", ["messages", "chat_template", "tokenize"])
def test_reserved_kwargs_rejected(key: str) -> None:
    """chat_template_kwargs cannot replace the messages or the template (400, as in vLLM)."""
    with pytest.raises(ChatTemplateError, match=f"may not set {key}") as info:
        _render("chatml", CHAT, chat_template_kwargs={key: []})
    assert info.value.param == "chat_template_kwargs"


def test_kwargs_override_request_arguments() -> None:
    """Like vLLM, chat_template_kwargs override add_generation_prompt and tools."""
    kwargs = {"add_generation_prompt": False, "tools": TOOLS}
    assert _render("chatml", TOOL_CHAT, chat_template_kwargs=kwargs) == EXPECTED_TOOLS["chatml"]


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("{{ {'k': '<é&>'} | tojson }}", '{"k": "<é&>"}'),
        ("{{ {'b': 1, 'a': [1]} | tojson(indent=2) }}", '{\n  "b": 1,\n  "a": [\n    1\n  ]\n}'),
        ("{{ bos_token }}|{{ eos_token }}|{{ pad_token }}", "<|begin_of_text|>|<|eot_id|>|<|end_of_text|>"),
        (
            "{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}{{ m.role }}{% endfor %}",
            "assistant",
        ),
        ("{% generation %}{{ messages | length }}{% endgeneration %}", "2"),
        ("{{ strftime_now('%Y') | length }}", "4"),
        ("{{ tools is none }}/{{ documents is none }}/{{ add_generation_prompt }}", "True/True/True"),
    ],
    ids=[
        "tojson-no-escaping",
        "tojson-indent",
        "special-tokens",
        "loopcontrols",
        "generation-tag",
        "strftime",
        "hf-vars",
    ],
)
def test_environment_matches_transformers(source: str, expected: str, tok: Tokenizer) -> None:
    """The Jinja environment offers what HF's does: plain tojson, loop controls, globals, variables."""
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert render_chat(tok, ChatTemplate(source), messages) == expected


@pytest.mark.parametrize(
    ("source", "content_format"),
    [
        ("{% for m in messages %}{{ m.content }}{% endfor %}", "string"),
        ("{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}", "openai"),
        (
            "{% set ms = messages[1:] %}{% for m in ms %}{% for p in m['content'] %}{% endfor %}{% endfor %}",
            "openai",
        ),
    ],
    ids=["string", "loops-over-content", "via-assigned-slice"],
)
def test_content_format_detection(source: str, content_format: str) -> None:
    """A template looping over message content is detected as 'openai' content format, like vLLM."""
    assert ChatTemplate(source).content_format == content_format


def test_shipped_template_names() -> None:
    """Only the two shipped names resolve; other flag values are told apart before loading."""
    assert [is_template_name(n) for n in ("chatml", "llama3", "mistral")] == [True, True, False]
    assert all(shipped_template(n).is_file() for n in TEMPLATE_NAMES)
    with pytest.raises(ValueError, match="unknown shipped template"):
        shipped_template("mistral")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", TEMPLATE_NAMES)
def test_shipped_templates_take_string_content(name: TemplateName) -> None:
    """The shipped templates get string content from vLLM (their part handling lives in a macro)."""
    assert shipped_chat_template(name).content_format == "string"


def test_openai_format_template_gets_parts(tok: Tokenizer) -> None:
    """With an 'openai'-format template, string content reaches it as one text part."""
    source = (
        "{% for m in messages %}{% for p in m.content %}[{{ p.type }}:{{ p.text }}]{% endfor %}{% endfor %}"
    )
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "a"},
        {"role": "user", "content": [{"type": "text", "text": "b"}, "c"]},
    ]
    assert render_chat(tok, ChatTemplate(source), messages) == "[text:a][text:b][text:c]"


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda p: ChatTemplate("{% if %}", name="broken"), "line 1"),
        (lambda p: ChatTemplate.from_file(p / "absent.jinja"), "cannot read"),
    ],
    ids=["syntax-error", "missing-file"],
)
def test_load_errors_are_config_errors(tmp_path: Path, make: Any, match: str) -> None:
    """A template that cannot be read or compiled is a ChatTemplateLoadError (config), not a 400."""
    with pytest.raises(ChatTemplateLoadError, match=match) as info:
        make(tmp_path)
    assert isinstance(info.value, ConfigError) and not isinstance(info.value, BadRequest)


def test_cached_compiles_once() -> None:
    """ChatTemplate.cached returns the same compiled template for the same source."""
    assert ChatTemplate.cached("{{ 1 }}") is ChatTemplate.cached("{{ 1 }}")


# --- tokens --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "markers"),
    [
        ("llama3", {"<|start_header_id|>": 2, "<|end_header_id|>": 3, "<|eot_id|>": 4}),
        ("chatml", {"<|im_start|>": 5, "<|im_end|>": 6}),
    ],
    ids=["llama3", "chatml"],
)
def test_template_markers_are_single_special_tokens(
    name: TemplateName, markers: dict[str, int], tok: Tokenizer
) -> None:
    """Every special string the template writes becomes one special id, once per occurrence."""
    text = _render(name, CHAT)
    ids = tokenize_chat(tok, shipped_chat_template(name), CHAT)
    for marker, token_id in markers.items():
        assert ids.count(token_id) == text.count(marker) > 0
    assert tok.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize(
    ("add_special_tokens", "bos_count"), [(False, 1), (True, 2)], ids=["vllm-chat-default", "double-bos"]
)
def test_chat_bos_comes_from_the_template(add_special_tokens: bool, bos_count: int, tok: Tokenizer) -> None:
    """Chat tokenization leaves BOS to the template; add_special_tokens=True would double it."""
    ids = tokenize_chat(tok, shipped_chat_template("llama3"), CHAT, add_special_tokens=add_special_tokens)
    assert ids[:bos_count] == [0] * bos_count and ids[bos_count] != 0


def test_templates_disagree_on_tokens(tok: Tokenizer) -> None:
    """The same conversation gives different ids under ChatML and Llama-3 (how a mismatch shows)."""
    chatml = tokenize_chat(tok, shipped_chat_template("chatml"), CHAT)
    llama3 = tokenize_chat(tok, shipped_chat_template("llama3"), CHAT)
    assert chatml != llama3
    assert chatml[0] == 5 and llama3[0] == 0


def test_default_template_is_the_tokenizers(tok: Tokenizer) -> None:
    """Without an explicit template the tokenizer's own (Llama-3) template is used."""
    assert render_chat(tok, None, CHAT) == _render("llama3", CHAT)


def test_no_template_anywhere(tok: Tokenizer, tmp_path: Path) -> None:
    """A tokenizer without a template and no configured one is a 400 like vLLM's."""
    bare = Tokenizer(tok.backend, name="bare")
    with pytest.raises(ChatTemplateError, match="no chat template"):
        render_chat(bare, None, CHAT)
