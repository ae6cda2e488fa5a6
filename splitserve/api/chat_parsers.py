"""How the server reads chat outputs (vLLM's `--reasoning-parser` and `--tool-call-parser`): the
setting, and its command-line flags."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from splitserve.api.reasoning import REASONING_PARSERS
from splitserve.api.tool_calls import LLAMA3_JSON, TOOL_CALL_PARSERS


@dataclass(frozen=True)
class ChatParsers:
    """`reasoning`: one of REASONING_PARSERS (the `<think>` part becomes the message's reasoning),
    or None (all content); `tool_calls`: one of TOOL_CALL_PARSERS."""

    reasoning: str | None = None
    tool_calls: str = LLAMA3_JSON


def add_arguments(p: argparse.ArgumentParser, config_fallback: bool) -> None:
    """`--reasoning-parser` and `--tool-call-parser`, None when not given: then the cluster
    config's (`config_fallback`), else ChatParsers' defaults."""
    given = "the config's {}, else {}" if config_fallback else "{1}"
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="put a reasoning model's <think> ... </think> in the chat message's reasoning "
                        f"(default: {given.format('reasoning_parser', 'none')})")
    p.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help="the format the model writes tool calls in; hermes for Qwen2.5 / Qwen3, mistral for Mistral, "
                        "granite for Granite 3.x, glm45 for GLM-4.5 / 4.6, minimax_m2 for MiniMax-M2, "
                        "qwen3_coder for Qwen3-Coder, seed_oss for Seed-OSS "
                        f"(default: {given.format('tool_call_parser', ChatParsers.tool_calls)})")


def from_arguments(args: argparse.Namespace) -> ChatParsers:
    """The flags' setting, ChatParsers' defaults where not given."""
    return ChatParsers(args.reasoning_parser, args.tool_call_parser or ChatParsers.tool_calls)
