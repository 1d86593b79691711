"""Chat templates as transformers 5 loads, selects and renders them.

Loading (``load_chat_templates``): the files ``save_pretrained`` writes today take priority over
``tokenizer_config.json``: ``chat_template.jinja`` is the template named ``default`` and each
``additional_chat_templates/NAME.jinja`` adds the template ``NAME``; only ``default`` gives one
string, several give a dict. Without those files, ``tokenizer_config.json``'s ``chat_template``
is read: a string, a dict of named templates, or the legacy list of ``{"name", "template"}``.

Selection (``select_template``): a dict gives ``tool_use`` when tools are passed and it has one,
else ``default``; without ``default`` it is an error listing the names.

Rendering (``render_chat``): transformers' environment (sandboxed, ``trim_blocks`` and
``lstrip_blocks``, ``loopcontrols``, the ``{% generation %}`` tag rendering its body, its
``tojson`` filter and its ``raise_exception``, ``strftime_now``, ``dict`` and ``namespace``
globals) with the variables it passes: the messages (keys whose value is None dropped, the
reasoning aliased), ``tools``, ``documents`` (None), ``add_generation_prompt`` and the named
special tokens (``special_tokens``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from inferflow.models.errors import CheckpointError

CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
# transformers' named special tokens (``SPECIAL_TOKENS_ATTRIBUTES``): the template sees each one set
SPECIAL_TOKENS_ATTRIBUTES = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)
# Names a message's reasoning is passed under; templates read the first (transformers' aliasing).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

ChatTemplates = str | dict[str, str]


def load_chat_templates(folder: Path, config: Mapping[str, object]) -> ChatTemplates | None:
    """The checkpoint's chat template(s) (see the module docstring); ``config`` is its
    ``tokenizer_config.json``. None when it has none."""
    files: dict[str, str] = {}
    default = folder / CHAT_TEMPLATE_FILE
    if default.is_file():
        files["default"] = default.read_text(encoding="utf-8")
    extra = folder / CHAT_TEMPLATE_DIR
    if extra.is_dir():
        for path in sorted(extra.glob("*.jinja")):
            files[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if files:
        return files["default"] if list(files) == ["default"] else files
    return _config_templates(folder / "tokenizer_config.json", config.get("chat_template"))


def _config_templates(path: Path, value: object) -> ChatTemplates | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):  # legacy form of several templates
        try:
            value = {item["name"]: item["template"] for item in value}
        except (TypeError, KeyError):
            value = None
    if isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        return value
    raise CheckpointError(
        path, 'chat_template: must be a string, a dict of named templates or a list of '
        '{"name": ..., "template": ...}'
    )


def select_template(templates: ChatTemplates | None, tools: object | None = None) -> str:
    """The template ``apply_chat_template`` uses (transformers' ``get_chat_template``)."""
    if templates is None:
        raise ValueError(
            f"this checkpoint has no chat template (looked for {CHAT_TEMPLATE_FILE}, "
            f"{CHAT_TEMPLATE_DIR}/*.jinja and tokenizer_config.json's chat_template)"
        )
    if isinstance(templates, str):
        return templates
    if tools is not None and "tool_use" in templates:
        return templates["tool_use"]
    if "default" in templates:
        return templates["default"]
    raise ValueError(
        "this checkpoint has several chat templates and none named default; "
        f"its templates: {sorted(templates)}"
    )


def special_tokens(folder: Path, config: Mapping[str, object]) -> dict[str, str]:
    """The named special tokens transformers passes to the template (its ``special_tokens_map``):
    the standard ones and model-specific ``*_token`` strings of ``tokenizer_config.json``; a
    legacy ``special_tokens_map.json`` (read when the config has no ``added_tokens_decoder``)
    overrides them."""
    found: dict[str, object] = {
        k: v for k, v in config.items()
        if k in SPECIAL_TOKENS_ATTRIBUTES or (k.endswith("_token") and isinstance(v, str))
    }
    extra = config.get("extra_special_tokens")
    if isinstance(extra, dict):
        found.update(extra)
    legacy = folder / "special_tokens_map.json"
    if "added_tokens_decoder" not in config and legacy.is_file():
        try:
            mapping = json.loads(legacy.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise CheckpointError(legacy, f"cannot be parsed ({exc})") from None
        if isinstance(mapping, dict):
            found.update({k: v for k, v in mapping.items() if k.endswith("_token")})
    out = {k: token_text(v) for k, v in found.items()}
    return {k: v for k, v in out.items() if v is not None}


def token_text(value: object) -> str | None:
    """Special tokens are stored as strings or AddedToken dicts (``{"content": ...}``)."""
    if isinstance(value, dict):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return value if isinstance(value, str) else None


def normalize_messages(messages: Sequence[Mapping[str, object]]) -> list[dict[str, object]]:
    """Messages as transformers hands them to the template: keys whose value is None dropped
    (OpenAI clients send ``content: null``), the reasoning under ``reasoning_content`` and
    ``thinking`` when given under any of their names."""
    out = []
    for message in messages:
        m = {k: v for k, v in message.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if k in m), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def render_chat(
    template: jinja2.Template,
    messages: Sequence[Mapping[str, object]],
    tools: Sequence[Mapping[str, object]] | None,
    add_generation_prompt: bool,
    tokens: Mapping[str, str],
) -> str:
    """Render a compiled template with the variables transformers passes."""
    return template.render(
        messages=normalize_messages(messages),
        tools=[dict(t) for t in tools] if tools is not None else None,
        documents=None,
        add_generation_prompt=add_generation_prompt,
        **tokens,
    )


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers marks the assistant's tokens
    with it): renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


def _tojson(
    x: object, ensure_ascii: bool = False, indent: int | None = None,
    separators: tuple[str, str] | None = None, sort_keys: bool = False,
) -> str:
    # transformers' override: no HTML escaping, json.dumps' options exposed
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """``dict`` for templates: builds dicts, exposes nothing else."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace`` refusing underscore-prefixed attributes (no way to CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # (Jinja's signature trick)
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: object) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, "
                f"got {name!r}"
            )


def compile_template(source: str) -> jinja2.Template:
    """``source`` compiled in transformers' chat-template environment."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)
