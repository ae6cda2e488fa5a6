"""One choice of an OpenAI response built from its tokens as they come, wherever they come from (a
cluster run's deltas, or an offline engine's finished output): the visible text, the logprobs of
the tokens that made it, the echoed prompt, and the whole choice (reasoning split off, tool calls
parsed). Also what a request asks of its choices (`choice_options`) and best_of's pick
(`best_choices`)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from splitserve.api import response_bodies as R
from splitserve.api.chat_parsers import ChatParsers
from splitserve.api.chat_request import ChatCompletionRequest
from splitserve.api.logprob_bodies import Entry, chat_logprobs, completion_logprobs, token_id_name
from splitserve.api.request_models import GenerationRequest
from splitserve.api.reasoning import GPT_OSS, prompt_opens_thinking, reasoning_splitter, split_reasoning
from splitserve.api.tool_calls import HERMES, LLAMA3_JSON, find_tool_calls, offered
from splitserve.api.visible_text import TextStream
from splitserve.engine.output_constraint import HARMONY
from splitserve.engine.tokenizer import Tokenizer


class ChoiceText:
    """`echo`: the prompt's text, put in front of the first piece (completions' `echo`), with the
    prompt tokens' logprobs in front of the first token's; `generated=False` (echo with max_tokens
    0): the sampled token is left out, so the choice is the scored prompt alone. `tool_names`: the
    functions a chat offered (`tool_calls.offered`: each with its parameters' schema types); an
    output that is calls to them (in `tool_parser`'s format) comes back as `tool_calls`, with ids
    for the template of `call_ids` (the served tool_call_parser, which a forced call's JSON format
    does not change). `thinking`: with a reasoning parser, whether the
    prompt left the model thinking, or HARMONY (GPT-OSS's channels; None: no parser, the output is
    all content). `num_top`: the top alternatives per token the client asked logprobs of (None:
    none; logprobs may still come, for best_of's ranking alone); `ids_as_tokens`: they name tokens
    `token_id:{id}` (vLLM's return_tokens_as_token_ids)."""

    def __init__(self, kind: str, text: TextStream, prompt: Sequence[int], echo: str | None = None,
                 generated: bool = True, tool_names: Mapping[str, Mapping[str, str]] | None = None, index: int = 0,
                 num_top: int | None = None, tool_parser: str = LLAMA3_JSON, thinking: bool | str | None = None,
                 call_ids: str = LLAMA3_JSON, ids_as_tokens: bool = False):
        self.kind, self.text, self.prompt, self.index, self.num_top = kind, text, prompt, index, num_top
        self._name = token_id_name if ids_as_tokens else None
        self._echo, self.generated, self.tool_names = echo, generated, tool_names or {}
        self.tool_parser, self.thinking, self.call_ids = tool_parser, thinking, call_ids
        self.cumulative_logprob = 0.0  # of the sampled tokens, when logprobs come (best_of ranks by it)
        self._entries: list[Entry] = []  # of the text not yet handed out
        self._text_offset = 0  # completions' text_offset of the next token
        self.reasoning_tokens = 0  # usage's: the output's tokens through the last whose text is reasoning
        self._counter = None if thinking is None else reasoning_splitter(thinking)  # fed one token at a time
        self._counted = 0  # tokens fed to it

    def add(self, token_ids: Sequence[int], logprobs: Sequence[dict[int, float]] | None, finish_reason: str | None,
            prompt_logprobs: Sequence[dict[int, float] | None] | None = None) -> tuple[str, str | None]:
        """(text delta, finish reason) after these tokens. The reason is "stop" as soon as a stop
        string shows, whether or not the run has ended (`self.text.stopped`: then stop it)."""
        if logprobs is not None:
            self.cumulative_logprob += sum(lps[t] for t, lps in zip(token_ids, logprobs))
        echoed = self._take_echo(prompt_logprobs)
        taken = self.text.append(token_ids, finish_reason == "stop") if self.generated else 0
        if self.num_top is not None and logprobs is not None:
            self._entries += zip(token_ids[:taken], logprobs[:taken])
        reason = "stop" if self.text.stopped else finish_reason
        if self._counter is not None:
            self._count_reasoning(final=reason is not None)
        return echoed + self.text.delta(final=reason is not None), reason

    def _count_reasoning(self, final: bool) -> None:
        """Each new token's text through the counting splitter: a token whose text (or a tag held
        until it) comes out as reasoning makes every token up to it a reasoning token."""
        ends, text = self.text.token_ends, self.text.visible(final=True)
        for i in range(self._counted, len(ends)):
            if self._counter.feed(text[ends[i - 1] if i else 0:ends[i]])[0]:
                self.reasoning_tokens = i + 1
        self._counted = len(ends)
        if final and self._counter.feed("", final=True)[0]:
            self.reasoning_tokens = len(ends)

    def _take_echo(self, prompt_logprobs) -> str:
        """The echoed prompt, once (its logprobs join the entries; the first prompt token has none)."""
        if self._echo is None:
            return ""
        echoed, self._echo = self._echo, None
        if self.num_top is not None and prompt_logprobs is not None:
            self._entries += zip(self.prompt, (None, *prompt_logprobs[1:]))
        return echoed

    @property
    def pending_logprobs(self) -> int:
        """Tokens whose logprobs the next `take_logprobs` (or `choice`) builds."""
        return len(self._entries)

    def take_logprobs(self) -> dict | None:
        """The logprobs object of the tokens since the last call, in this endpoint's shape."""
        if self.num_top is None:
            return None
        entries, self._entries = self._entries, []
        if self.kind == "chat":
            return chat_logprobs(entries, self.num_top, self._name or self.text.token_text, self.text.token_bytes)
        body = completion_logprobs(entries, self.num_top, self.text.token_text, self._text_offset, self._name)
        self._text_offset += sum(len(self.text.token_text(token_id)) for token_id, _ in entries)
        return body

    def choice(self, text: str, reason: str | None) -> dict:
        """The whole choice, `text` being every piece `add` gave."""
        logprobs = self.take_logprobs()
        if self.kind == "completion":
            return R.completion_choice(text, reason, logprobs, self.index)
        reasoning, content = (None, text) if self.thinking is None else split_reasoning(text, self.thinking)
        found = find_tool_calls(content or "", self.tool_names, self.tool_parser, self.call_ids) \
            if self.tool_names and reason == "stop" else None
        if found:
            before, calls = found
            return R.chat_choice(before, "tool_calls", logprobs, [c.body() for c in calls], self.index, reasoning)
        return R.chat_choice(content, reason, logprobs, index=self.index, reasoning=reasoning)


def choice_options(request: GenerationRequest, prompt_index: int, prompt: Sequence[int], tokenizer: Tokenizer,
                   parsers: ChatParsers = ChatParsers()) -> dict:
    """ChoiceText's `echo`, `generated`, `tool_names`, `num_top`, `tool_parser`, `thinking`,
    `call_ids` and `ids_as_tokens` for the choices of one of `request`'s prompts (`prompt`: its
    token ids). With a reasoning parser a constrained output (structured outputs, a forced tool call) is thought like
    any other (the constraint holds the answer after it); a forced call is parsed in the JSON format
    the constraint writes, and GPT-OSS's calls as the hermes calls its splitter spells them."""
    echo = None
    if request.echoes_prompt():  # a truncated prompt echoes the tokens the model saw
        text = request.prompts()[prompt_index]
        sent = isinstance(text, str) and request.truncate_prompt_tokens is None
        echo = text if sent else tokenizer.decode(prompt, skip_special_tokens=False)
    _, field = request.output_constraint()
    thinking = None
    if isinstance(request, ChatCompletionRequest) and parsers.reasoning is not None:
        thinking = HARMONY if parsers.reasoning == GPT_OSS else prompt_opens_thinking(prompt, tokenizer)
    tool_parser = LLAMA3_JSON if field == "tool_choice" else HERMES if thinking == HARMONY else parsers.tool_calls
    return dict(echo=echo, generated=not request.scores_prompt_only(),
                tool_names=offered(request.callable_functions()),
                num_top=request.requested_logprobs(),
                tool_parser=tool_parser, thinking=thinking, call_ids=parsers.tool_calls,
                ids_as_tokens=request.return_tokens_as_token_ids)


def best_choices(choices: list[dict], cumulative_logprobs: list[float], num_returned: int, first_index: int = 0
                 ) -> list[dict]:
    """best_of: the `num_returned` choices (of one prompt) whose sampled tokens are likeliest,
    indexed anew from `first_index`; all of them, as they are, when every computed choice is returned."""
    if num_returned >= len(choices):
        return choices
    ranked = sorted(zip(cumulative_logprobs, choices), key=lambda lc: -lc[0])
    return [{**choice, "index": first_index + i} for i, (_, choice) in enumerate(ranked[:num_returned])]
