"""The ``tool_parser`` and ``reasoning_parser`` slots: chosen on the command line, ``auto`` by
default, a plugin's own class by ``_target_``, and one line naming the key when wrong."""

from __future__ import annotations

from pathlib import Path

import pytest
from cfg_helpers import run_cli

from inferflow.cli import compose_config
from inferflow.config import ConfigError
from inferflow.graph import build_graph
from inferflow.stages.reasoning_parser import AutoReasoningParser, ThinkReasoningParser
from inferflow.stages.tool_parser import AutoToolParser, HermesToolParser, MistralToolParser


@pytest.mark.usefixtures("config_env")
def test_parsers_are_config_groups_defaulting_to_auto() -> None:
    default = build_graph(compose_config([]))
    assert type(default.tool_parser) is AutoToolParser
    assert type(default.reasoning_parser) is AutoReasoningParser
    chosen = build_graph(compose_config(["tool_parser=hermes", "reasoning_parser=think"]))
    assert type(chosen.tool_parser) is HermesToolParser
    assert type(chosen.reasoning_parser) is ThinkReasoningParser
    target = "tool_parser._target_=inferflow.stages.tool_parser.MistralToolParser"
    assert type(build_graph(compose_config([target])).tool_parser) is MistralToolParser
    markers = build_graph(compose_config(["reasoning_parser=think",
                                          "reasoning_parser.start='<reason>'"]))
    assert markers.reasoning_parser.start == "<reason>"  # type: ignore[attr-defined]
    wrong = "tool_parser._target_=inferflow.stages.reasoning_parser.ThinkReasoningParser"
    with pytest.raises(ConfigError, match="tool_parser"):
        build_graph(compose_config([wrong]))


def test_an_unknown_parser_is_one_line_naming_the_key(
    cli_env: dict[str, str], workdir: Path
) -> None:
    proc = run_cli(["tool_parser=qwen"], cli_env, workdir)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (
        "inferflow: tool_parser=qwen: unknown option; "
        "available: auto, hermes, json, llama3_json, mistral\n"
    )
