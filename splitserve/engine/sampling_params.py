"""Per-request generation settings (vLLM's `SamplingParams` shape), validated on construction."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from splitserve.engine.output_constraint import OutputConstraint

# Below this temperature sampling is greedy (as vLLM does): dividing logits by a smaller one
# overflows float32, and the distribution is the argmax's anyway.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGIT_BIAS = 300  # tokens one request may bias (OpenAI's bound)
MAX_REPETITION_PENALTY = 10.0
MAX_LOGPROBS = 20  # top alternatives per token (vLLM's bound)
MAX_LORA_NAME = 256  # characters in a LoRA adapter's name (as a served model name)
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # ids in allowed_token_ids: more than the largest vocabularies'
MAX_BAD_WORDS, MAX_BAD_WORD_CHARS = 128, 256  # words in bad_words, characters in one
MAX_CACHE_SALT = 1024  # characters in a cache_salt
MAX_PRIORITY = 2**31 - 1  # a priority's magnitude at most
MAX_LABEL_TOKENS = 16  # label_token_ids at most
MAX_PREDICTION_TOKENS = 1 << 18  # prediction's ids at most (an ingress bounds it by the context)
MAX_TOKEN_ID = 2**32 - 2  # ids fit 4 bytes, with one value to spare (speculation's start-of-output mark)
# Temperatures reach the device as float32: one past its largest value would divide -inf by inf
# (NaN, a row nothing can be drawn from).
MAX_TEMPERATURE = 3.4028234663852886e38


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    Invalid values raise `ValueError` naming the field, so a bad request is rejected before it
    can join a batch.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to return per token, besides the sampled one
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (computed in the prefill)
    min_p: float = 0.0  # drop tokens less likely than min_p times the top token (after temperature)
    presence_penalty: float = 0.0   # OpenAI's: subtracted once from a token already in the output
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # transformers': divides (multiplies) the positive (negative) logit
    # of a token in the prompt or the output
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), OpenAI's logit_bias
    allowed_token_ids: tuple[int, ...] | None = None  # vLLM's: only these ids may be sampled; None: any
    bad_words: tuple[str, ...] = ()  # vLLM's: words the output may not contain (engine.bad_words)
    constraint: OutputConstraint | None = None  # structured output: what the text must match
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True  # False: the output's text stays "" (a caller that decodes the ids itself)
    # latency targets the SLO-aware (accelgen) policies schedule for; other policies ignore them
    ttft_slo_s: float | None = None  # time to first token
    tbt_slo_s: float | None = None   # time between tokens
    # the prompt's last this many tokens are this request's own output from an earlier attempt (a
    # failover resumed it elsewhere): seeded draws, frequency and presence penalties and structured
    # output count them as output, so the request goes on as if it had never moved
    resumed_tokens: int = 0
    lora: str | None = None  # the LoRA adapter (its name, as the engine loaded it) to run with; None: the base model
    # the identity of `lora` where the request was placed (a cluster's CLS): an engine holding
    # another adapter under that name (loaded again meanwhile) refuses the request; None: any
    lora_identity: str | None = None
    # vLLM's: prefix-cache blocks are shared only between requests of the same salt (prefix_hash.chain_root)
    cache_salt: str | None = None
    priority: int = 0  # vLLM's: with scheduling_policy priority, a lower value is scheduled first
    # the prompt's embedding: its last position's final hidden state, L2-normalized (last-token
    # pooling, as decoder embedding models such as Qwen3-Embedding and e5-mistral pool); max_tokens 1
    embed: bool = False
    # with embed: pool the LM head's logits at these ids instead (raw, at the same position): a
    # reranker that answers in tokens reads its verdict there (Qwen3-Reranker's "no" and "yes")
    label_token_ids: tuple[int, ...] = ()
    # OpenAI's Predicted Outputs: token ids much of the output is expected to repeat (a file being
    # edited); where the engine speculates, a decode drafts from them first (engine.speculation)
    prediction: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", _as_tuple(self.stop, "stop", str))
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids, "stop_token_ids", int))
        object.__setattr__(self, "label_token_ids", _as_tuple(self.label_token_ids, "label_token_ids", int))
        object.__setattr__(self, "prediction", _as_tuple(self.prediction, "prediction", int))
        _check(all(t >= 0 for t in self.stop_token_ids),
               f"stop_token_ids must be ids >= 0, got {self.stop_token_ids!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize", "embed"):
            _check(isinstance(getattr(self, name), bool), f"{name} must be a bool, got {getattr(self, name)!r}")
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1, f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _check(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
               f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        _check(_is_number(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE,
               f"temperature must be a number in [0, {MAX_TEMPERATURE:.4g}] (float32's), got {self.temperature!r}")
        _check(_is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1), f"top_k must be -1 (disabled) or >= 1, got {self.top_k!r}")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(self.seed is None or _is_int(self.seed), f"seed must be an integer or None, got {self.seed!r}")
        self._check_request()
        self._check_output()

    def _check_request(self) -> None:
        """What the request is (an embedding, its label tokens), and what it runs under (adapter,
        cache salt, priority, tokens resumed)."""
        _check(not self.embed or self.max_tokens == 1,
               f"embed needs max_tokens 1 (its prefill's), got {self.max_tokens}")
        _check(not self.label_token_ids or (self.embed and len(self.label_token_ids) <= MAX_LABEL_TOKENS
                                            and all(t >= 0 for t in self.label_token_ids)),
               f"label_token_ids must be at most {MAX_LABEL_TOKENS} ids >= 0, with embed, got "
               f"{self.label_token_ids!r:.80}")
        _check(self.lora is None or (isinstance(self.lora, str) and 0 < len(self.lora) <= MAX_LORA_NAME),
               f"lora must be an adapter's name (1 to {MAX_LORA_NAME} characters) or None, got {self.lora!r}")
        _check(self.lora_identity is None or (self.lora is not None and isinstance(self.lora_identity, str)),
               f"lora_identity must be a string, with lora, or None, got {self.lora_identity!r:.80}")
        _check(self.cache_salt is None
               or (isinstance(self.cache_salt, str) and 0 < len(self.cache_salt) <= MAX_CACHE_SALT),
               f"cache_salt must be a string of 1 to {MAX_CACHE_SALT} characters or None, got {self.cache_salt!r:.80}")
        _check(_is_int(self.priority) and abs(self.priority) <= MAX_PRIORITY,
               f"priority must be an integer in [{-MAX_PRIORITY}, {MAX_PRIORITY}], got {self.priority!r}")
        _check(_is_int(self.resumed_tokens) and self.resumed_tokens >= 0,
               f"resumed_tokens must be an integer >= 0, got {self.resumed_tokens!r}")

    def _check_output(self) -> None:
        """What shapes the output: logprobs, stop strings, penalties, biases, bans, a constraint,
        latency targets (the lists made tuples)."""
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (_is_int(value) and 0 <= value <= MAX_LOGPROBS),
                   f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None, got {value!r}")
        _check(all(s for s in self.stop), "stop strings must be non-empty")
        _check(self.detokenize or not self.stop, "detokenize must be True with stop strings: finding them needs the text")
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2 <= value <= 2, f"{name} must be in [-2, 2], got {value!r}")
        _check(_is_number(self.repetition_penalty) and 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY,
               f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty!r}")
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        object.__setattr__(self, "allowed_token_ids", _allowed_ids(self.allowed_token_ids))
        object.__setattr__(self, "bad_words", _as_tuple(self.bad_words, "bad_words", str))
        _check(len(self.bad_words) <= MAX_BAD_WORDS, f"bad_words may hold at most {MAX_BAD_WORDS} words, "
               f"got {len(self.bad_words)}")
        _check(all(w.strip() and len(w) <= MAX_BAD_WORD_CHARS for w in self.bad_words),
               f"bad_words must be words of 1 to {MAX_BAD_WORD_CHARS} characters, not only spaces, "
               f"got {self.bad_words!r}")
        if self.constraint is not None:
            _check(isinstance(self.constraint, OutputConstraint),
                   f"constraint must be an OutputConstraint or None, got {self.constraint!r}")
            # a finished match allows only EOS: holding EOS back would leave no token to sample
            _check(not self.ignore_eos and not self.min_tokens,
                   "constraint (structured output) cannot be combined with ignore_eos or min_tokens")
        _check(len(self.prediction) <= MAX_PREDICTION_TOKENS and all(0 <= t <= MAX_TOKEN_ID for t in self.prediction),
               f"prediction must be at most {MAX_PREDICTION_TOKENS} token ids in [0, {MAX_TOKEN_ID}], got "
               f"{len(self.prediction)} ({self.prediction[:8]!r})")
        for name in ("ttft_slo_s", "tbt_slo_s"):
            value = getattr(self, name)
            _check(value is None or (_is_number(value) and math.isfinite(value) and value > 0),
                   f"{name} must be a finite number of seconds > 0 or None, got {value!r}")

    @classmethod
    def embedding(cls, lora: str | None = None, label_token_ids: tuple[int, ...] = ()) -> SamplingParams:
        """A request for the prompt's embedding alone (under adapter `lora`), or its logits at
        `label_token_ids`: its prefill, one greedy token not decoded to text."""
        return cls(max_tokens=1, temperature=0.0, detokenize=False, embed=True, lora=lora,
                   label_token_ids=label_token_ids)

    def ids_only(self) -> SamplingParams:
        """These params for a caller that decodes the output ids itself (a cluster's ingress, a
        batch's response): the engine then decodes text only to find stop strings."""
        return self if self.stop or not self.detokenize else replace(self, detokenize=False)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias)


def _bias_pairs(value) -> tuple[tuple[int, float], ...]:
    """(token id, bias) pairs from a dict or pairs (None: none): ids >= 0, each once (a repeated id
    would add its biases up), biases in [-100, 100] (OpenAI's range)."""
    if value is None:
        return ()
    if isinstance(value, dict):
        pairs = tuple(value.items())
    else:
        _check(isinstance(value, (list, tuple)) and all(isinstance(p, (list, tuple)) for p in value),
               f"logit_bias must be a dict of token ids to biases or (token id, bias) pairs, got {value!r}")
        pairs = tuple(tuple(p) for p in value)
    _check(len(pairs) <= MAX_LOGIT_BIAS, f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {len(pairs)}")
    for pair in pairs:
        _check(len(pair) == 2 and _is_int(pair[0]) and pair[0] >= 0 and _is_number(pair[1])
               and -100 <= pair[1] <= 100, f"logit_bias maps token ids >= 0 to numbers in [-100, 100], got {pair!r}")
    ids = [t for t, _ in pairs]
    _check(len(set(ids)) == len(ids), f"logit_bias names a token id more than once: {sorted(ids)!r}")
    return tuple(sorted((int(t), float(b)) for t, b in pairs))


def _allowed_ids(value) -> tuple[int, ...] | None:
    """allowed_token_ids as sorted distinct ids >= 0; None: any id (an empty list would allow none)."""
    if value is None:
        return None
    ids = _as_tuple(value, "allowed_token_ids", int)
    _check(0 < len(ids) <= MAX_ALLOWED_TOKEN_IDS and all(t >= 0 for t in ids),
           f"allowed_token_ids must be 1 to {MAX_ALLOWED_TOKEN_IDS} token ids >= 0, got {len(ids)} "
           f"({ids[:8]!r}{'...' if len(ids) > 8 else ''})")
    return tuple(sorted(set(ids)))


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _as_tuple(value, name: str, kind: type) -> tuple:
    if value is None:
        return ()
    if isinstance(value, kind):
        value = (value,)
    value = tuple(value)
    _check(all(isinstance(v, kind) and not isinstance(v, bool) for v in value),
           f"{name} must be a list of {kind.__name__}, got {value!r}")
    return value
