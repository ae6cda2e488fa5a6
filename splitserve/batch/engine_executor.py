"""A batch file run on one in-process engine (`splitserve batch`, and the batch API's executor
when no cluster serves it): lines prepared like HTTP requests, run in BlendServe (or dfs / fcfs)
order, every result synced to the output or error log as it finishes, so a rerun after a crash
resumes where the logs end. A result line's body is what the line's endpoint would answer (an
embeddings, score or rerank line's: made of its texts' embeddings, each a prompt-only request)."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from splitserve.api import response_bodies as R
from splitserve.api.chat_parsers import ChatParsers
from splitserve.api.choice_text import ChoiceText, best_choices, choice_options
from splitserve.api.lazy_grammar import LazyGrammar
from splitserve.api.limits import RequestLimits
from splitserve.api.prepared_request import PreparedRequest
from splitserve.api.request_models import ModelNames
from splitserve.api.request_sampling import choice_params
from splitserve.api.usage import Usage
from splitserve.api.visible_text import TextStream
from splitserve.batch.blend.feeder import BlendOptions
from splitserve.batch.engine_runner import BatchStats, run_batch
from splitserve.batch.lines import BatchLine, LineRules, Prepared, answer_line, prepare_pending
from splitserve.batch.results import ResultLog
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.outputs import RequestOutput
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.tokenizer import Tokenizer


def run_lines(engine: LLMEngine, lines: list[BatchLine], model: ModelNames, output: ResultLog,
              errors: ResultLog, options: BlendOptions, stop: Callable[[], bool] = lambda: False,
              on_result: Callable[[bool], None] = lambda ok: None, limits: RequestLimits = RequestLimits(),
              parsers: ChatParsers = ChatParsers(), score_labels: tuple[int, ...] = ()) -> BatchStats:
    """Run every line without a result in `output` or `errors`; lines already there count as
    samples of output length. A line runs as one engine request per computed choice (`n`,
    `best_of`) of each of its prompts, each choice with its seed (the order keeps a prompt's
    choices together, so it is prefilled once), or per text an embeddings, score or rerank line
    embeds, and is logged when its last one ends.
    `on_result(ok)` after each line is logged; `parsers`: how chat outputs are read; `score_labels`:
    a token-answering reranker's label ids, with which score and rerank lines run a prompt per pair."""
    grammar = LazyGrammar(engine.tokenizer, engine.model_config.vocab_size)
    rules = LineRules(engine.tokenizer, model, engine.max_model_len, engine.model_config.hidden_size, limits,
                      grammar.check, parsers, score_labels=score_labels)
    jobs, finished_lines = prepare_pending(lines, rules, output, errors, on_result)
    requests = [_engine_requests(prepared) for _, prepared in jobs]
    runs = [len(mine) for mine in requests]
    keys = [(job, run) for job in range(len(jobs)) for run in range(runs[job])]
    items = [item for mine in requests for item in mine]
    finished = {key: finished_lines[job] // runs[job] for key, (job, _) in enumerate(keys) if job in finished_lines}
    ended: dict[int, dict[int, RequestOutput]] = {}  # job -> its runs' outputs, until all have ended

    def record(key: int, out: RequestOutput) -> None:
        job, run = keys[key]
        line, prepared = jobs[job]
        outs = ended.setdefault(job, {})
        outs[run] = out
        if len(outs) == runs[job]:
            del ended[job]
            ordered = [outs[i] for i in range(runs[job])]
            body = (response(line.runs_as, prepared, ordered, engine.tokenizer, parsers)
                    if isinstance(prepared, PreparedRequest) else prepared.body([out.embedding for out in ordered]))
            output.append(answer_line(line, prepared, body))
            on_result(True)

    return run_batch(engine, items, options, record, finished, stop=stop)


def _engine_requests(prepared: Prepared) -> list[tuple[list[int], SamplingParams]]:
    """A line's engine requests, in order: every computed choice of each prompt (prompt k's choice i
    at k x computed + i; the texts a line embeds, once each), the ids alone (`response` decodes them)."""
    return [(prompt, choice_params(params, index).ids_only())
            for prompt, params in zip(prepared.prompts, prepared.params) for index in range(prepared.runs_per_prompt)]


def response(kind: str, prepared: PreparedRequest, outs: list[RequestOutput], tokenizer: Tokenizer,
             parsers: ChatParsers = ChatParsers()) -> dict:
    """The endpoint's response body from the engine's outputs of every computed choice, prompt by
    prompt (prompt k's choice i at k x computed + i); a prompt's cache hit is its first choice's,
    its cache writes every choice's."""
    computed, returned = prepared.request.num_choices()
    choices, completion_tokens, reasoning_tokens = [], 0, 0
    for k, (prompt, params) in enumerate(zip(prepared.prompts, prepared.params)):
        options = choice_options(prepared.request, k, prompt, tokenizer, parsers)
        mine, ranks = [], []
        for index, out in enumerate(outs[k * computed:(k + 1) * computed]):
            stream = TextStream(tokenizer, choice_params(params, index), prompt)
            text = ChoiceText(kind, stream, prompt, index=k * returned + index, **options)
            piece, reason = text.add(out.token_ids, out.outputs[0].logprobs, out.finish_reason, out.prompt_logprobs)
            mine.append(text.choice(piece, reason))
            ranks.append(text.cumulative_logprob)
            completion_tokens += len(out.token_ids) if options["generated"] else 0
            reasoning_tokens += text.reasoning_tokens
        choices += best_choices(mine, ranks, returned, k * returned)
    cached_tokens = sum(out.num_cached_tokens for out in outs[::computed])
    usage = Usage(sum(map(len, prepared.prompts)), completion_tokens, cached_tokens, reasoning_tokens,
                  sum(out.num_cache_write_tokens for out in outs), sum(out.accepted_prediction_tokens for out in outs),
                  sum(out.rejected_prediction_tokens for out in outs))
    return R.response_body(kind, R.new_request_id(kind), prepared.request.model, int(time.time()), choices, usage)


class EngineExecutor:
    """The batch service's executor on one in-process engine (run in a thread, off the event loop)."""

    def __init__(self, engine: LLMEngine, model: str | tuple[str, ...], limits: RequestLimits = RequestLimits(),
                 parsers: ChatParsers = ChatParsers()):
        self.engine, self.model, self.limits, self.parsers = engine, model, limits, parsers

    async def run(self, lines: list[BatchLine], output: ResultLog, errors: ResultLog, options: BlendOptions,
                  stop: Callable[[], bool], on_result: Callable[[bool], None]) -> None:
        await asyncio.to_thread(run_lines, self.engine, lines, self.model, output, errors, options, stop, on_result,
                                self.limits, self.parsers)
