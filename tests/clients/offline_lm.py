"""lm-evaluation-harness's `LM` over splitserve's offline engine: the reference a `local-completions`
run against a cluster must equal. It sends the engine what `local-completions` sends the server
(lm-eval 0.4's `TemplateAPI` and `LocalCompletionsAPI`): the same token ids (text encoded without
special tokens, as the server's /tokenize does for lm-eval's remote tokenizer, and left-truncated
to the same lengths), greedy, with the same stop strings and token limits, one request at a time."""
from __future__ import annotations

import copy

from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences

from splitserve import LLM, SamplingParams


class OfflineLM(TemplateLM):
    def __init__(self, llm: LLM, max_length: int = 2048, max_gen_toks: int = 256, seed: int = 1234):
        super().__init__()
        self.llm = llm
        self.max_length = max_length - 1  # as TemplateAPI: one position is kept for the generated token
        self.max_gen_toks = max_gen_toks
        self.seed = seed

    def _spelled(self, token_id: int) -> str:
        """A special token's text, as the server's /tokenizer_info gives it."""
        return self.llm.get_tokenizer().decode([token_id], skip_special_tokens=False)

    @property
    def eos_string(self) -> str:
        return self._spelled(self.llm.get_tokenizer().eos_token_ids[0])

    @property
    def eot_token_id(self) -> int:
        # as lm-eval's RemoteTokenizer: the first id of the EOS token's text encoded without special
        # tokens (for the demo model, whose text never parses into special tokens, the byte "<")
        return self.tok_encode(self.eos_string)[0]

    @property
    def prefix_token_id(self) -> int:
        return self.tok_encode(self._spelled(self.llm.get_tokenizer().bos_token_id))[0]

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.llm.get_tokenizer().encode(string, add_special_tokens=False)

    def _loglikelihood_tokens(self, requests, **kwargs) -> list[tuple[float, bool]]:
        return [self._score(context, continuation) for _, context, continuation in requests]

    def _score(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """The continuation's summed prompt logprobs, and whether each of its tokens is the argmax
        (its logprob equals the top-1's, as local-completions compares them)."""
        ids = (context + continuation)[-self.max_length:]
        ctxlen = len(context) - max(0, len(context) + len(continuation) - self.max_length)
        params = SamplingParams(max_tokens=1, temperature=0, seed=self.seed, prompt_logprobs=1)
        positions = self.llm.generate([ids], params)[0].prompt_logprobs
        scored = [(positions[i][ids[i]], max(positions[i].values())) for i in range(ctxlen, len(ids))]
        return sum(lp for lp, _ in scored), all(lp == top for lp, top in scored)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        return [self._generate(*request.args) for request in requests]

    def _generate(self, context: str, gen_kwargs: dict) -> str:
        kwargs = copy.deepcopy(gen_kwargs)  # the task's own: handle_stop_sequences appends to `until`
        kwargs.pop("do_sample", None)
        max_tokens = kwargs.pop("max_gen_toks", self.max_gen_toks)
        ids = self.tok_encode(context)[-(self.max_length - max_tokens):]
        stop = handle_stop_sequences(kwargs.pop("until", None), self.eos_string)
        # what is left goes to the engine as the server gets it: extra fields of the request
        params = SamplingParams(max_tokens=max_tokens, temperature=kwargs.pop("temperature", 0), stop=stop,
                                seed=self.seed, **kwargs)
        return self.llm.generate([ids], params)[0].text

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        raise NotImplementedError("OfflineLM scores loglikelihood and generate_until tasks only")
