"""Speculative decoding by n-gram prompt lookup (vLLM's `ngram` method): a decode drafts the tokens
that followed the latest earlier occurrence of its context's last n tokens, and one step checks them.

A decode with drafts d_1..d_k computes its last token and the drafts as one query over its paged
context (as a prefill chunk does) and samples a token at each of the k + 1 rows; `accepted`
keeps each draft while it equals the token sampled at the row before it, then the first token that
differs (every draft kept: the last row's token too). A draft is one token for certain, so this is
rejection sampling's rule (keep d with probability p(d), else draw from p without d): every token
comes from the model's own distribution at its position. Greedy outputs are the tokens decoding one
at a time gives, and seeded ones too (a seeded draw depends on its output position alone).

A request with a `prediction` (OpenAI's Predicted Outputs) drafts from it first
(`prediction_lookup`), from its context where that has nothing; its drafts' fate is counted on the
sequence (usage's accepted_prediction_tokens and rejected_prediction_tokens) and does not back it
off.

Every decode drafts, whatever its sampling: what follows the tokens before a row (min_tokens,
penalties, bad words, a grammar) takes the drafts before it as kept (`Sampler.draw`), and a
structured output's drafts are cut to what its grammar allows.
What a step may add (`speculate`): drafts keep its tokens within the policy's largest step and its
sampled rows within max_num_seqs (what the memory profile ran), take only free blocks (a draft never
preempts), stop at max_tokens and max_model_len, and at the token where LongRoPE turns a sequence
long (`LLMEngine._turn_long_rope` sees that token last).
"""
from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.policies import Plan, ScheduledSeq
from splitserve.engine.prediction_lookup import TOKEN_BYTES, PredictionLookup
from splitserve.engine.sequence import Sequence

MAX_SPECULATIVE_TOKENS = 16  # num_speculative_tokens at most
MAX_LOOKUP_TOKENS = 64       # prompt_lookup_max at most
MAX_BACKOFF_STEPS = 16       # steps a sequence whose drafts keep failing waits between drafts, at most


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's speculative_config for the `ngram` method."""

    num_speculative_tokens: int = 0  # drafts a decode may take a step (0: no speculation)
    prompt_lookup_min: int = 2       # the shortest context ending looked up
    prompt_lookup_max: int = 4       # the longest (the longest that matches wins; then the latest)

    def __post_init__(self) -> None:
        if not 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in [0, {MAX_SPECULATIVE_TOKENS}], "
                             f"got {self.num_speculative_tokens!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= MAX_LOOKUP_TOKENS:
            raise ValueError(f"prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max <= "
                             f"{MAX_LOOKUP_TOKENS}, got {self.prompt_lookup_min!r} and {self.prompt_lookup_max!r}")

    @property
    def enabled(self) -> bool:
        return self.num_speculative_tokens > 0


class Proposer(Protocol):
    """What `speculate` asks of a proposer (NgramProposer; the simulator's SimDrafts)."""

    config: SpeculativeConfig

    def propose(self, seq: Sequence, limit: int) -> tuple[int, ...]: ...


class NgramProposer:
    """Drafts from each sequence's own tokens. A sequence's tokens are kept packed (4 bytes each),
    grown as it grows, so a lookup is `bytearray.rfind` at C speed rather than a Python scan.

    A sequence whose drafts were all rejected drafts again only after 1, then 2, 4 ... up to
    MAX_BACKOFF_STEPS steps, until one is kept (`checked`): output that copies nothing (sampled
    noise) soon stops paying for rows it throws away."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self._lookups: dict[Sequence, _Lookup] = {}

    def forget(self, seq: Sequence) -> None:
        self._lookups.pop(seq, None)

    def settle(self, plan: Plan, sampled: dict[str, list[int]]) -> int:
        """The step `plan` sampled `sampled` (per sequence, a token per row): each drafting
        sequence's tokens cut to those it gets (`accepted`), its backoff set by whether it kept
        a draft; the drafts kept in all."""
        total = 0
        for item in plan.scheduled:
            if item.drafts:
                tokens = sampled[item.seq.seq_id] = accepted(item.drafts, sampled[item.seq.seq_id])
                self.checked(item.seq, len(item.drafts), len(tokens) - 1)
                total += len(tokens) - 1
        return total

    def checked(self, seq: Sequence, drafted: int, kept: int) -> None:
        """A step checked `drafted` drafts of seq's and kept `kept` of them."""
        lookup = self._lookups[seq]
        if lookup.predicted:
            seq.accepted_prediction_tokens += kept
            seq.rejected_prediction_tokens += drafted - kept
            return
        lookup.backoff = 0 if kept else min(2 * lookup.backoff or 1, MAX_BACKOFF_STEPS)
        lookup.skip = lookup.backoff

    def propose(self, seq: Sequence, limit: int) -> tuple[int, ...]:
        """`limit` tokens that followed the latest earlier occurrence of the longest of seq's endings
        of prompt_lookup_max down to prompt_lookup_min tokens; () when none occurs (or while it
        backs off). Where the tokens after that occurrence run into the end, they go on as the copy
        they start (an occurrence d tokens back repeats with period d, as an LZ77 copy overlapping
        itself does)."""
        lookup = self._lookups.get(seq)
        if lookup is None:
            lookup = self._lookups[seq] = _Lookup(seq.params.prediction)
        tokens, packed = seq.token_ids, lookup.packed
        packed += array("I", tokens[len(packed) // TOKEN_BYTES:]).tobytes()
        total = len(tokens)
        lookup.predicted = False
        if lookup.prediction is not None:
            cfg, outputs = self.config, total - seq.num_prompt_tokens + seq.params.resumed_tokens
            drafts = lookup.prediction.drafts(packed, outputs, limit, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
            if drafts:
                lookup.predicted = True
                return drafts
        if lookup.skip:
            lookup.skip -= 1
            return ()
        for n in range(min(self.config.prompt_lookup_max, total - 1), self.config.prompt_lookup_min - 1, -1):
            found = _latest(packed, bytes(packed[(total - n) * TOKEN_BYTES:]), (total - 1) * TOKEN_BYTES)
            if found is not None:
                start = found // TOKEN_BYTES + n
                period = total - start
                return tuple(tokens[start + j % period] for j in range(limit))
        return ()


def accepted(drafts: tuple[int, ...], sampled: list[int]) -> list[int]:
    """The tokens a sequence gets from its rows' `sampled` tokens (1 + len(drafts) of them): each
    draft while it equals the token sampled at the row before it, then the first that differs."""
    for i, draft in enumerate(drafts):
        if sampled[i] != draft:
            return sampled[:i + 1]
    return sampled


class _Lookup:
    """One sequence's: its tokens packed so far, its backoff (steps it skips, and skips next), its
    prediction's lookup (None: none), and whether its latest drafts came from there."""

    __slots__ = ("packed", "skip", "backoff", "prediction", "predicted")

    def __init__(self, prediction: tuple[int, ...] = ()) -> None:
        self.packed, self.skip, self.backoff = bytearray(), 0, 0
        self.prediction = PredictionLookup(prediction) if prediction else None
        self.predicted = False


def _latest(packed: bytearray, pattern: bytes, end: int) -> int | None:
    """The byte offset of the latest token-aligned occurrence of `pattern` in packed[:end]."""
    while (found := packed.rfind(pattern, 0, end)) >= 0:
        if found % TOKEN_BYTES == 0:
            return found
        end = found + len(pattern) - 1  # an unaligned match: look before it
    return None


def speculate(plan: Plan, proposer: Proposer, blocks: BlockManager, max_tokens: int, max_rows: int,
              max_model_len: int, long_rope_from: int | None = None,
              valid: Callable[[Sequence, tuple[int, ...]], int] | None = None) -> Plan:
    """`plan` with drafts given to its decodes, oldest first, within the step's limits (module doc):
    at most `max_tokens` tokens and `max_rows` sampled rows in all; a structured output's drafts
    cut to those its grammar allows (`valid`: how many, from the first)."""
    room = min(max_tokens - plan.num_tokens, max_rows - sum(item.samples for item in plan.scheduled))
    k = proposer.config.num_speculative_tokens
    items = list(plan.scheduled)
    for i, item in enumerate(items):
        if room <= 0:
            break
        seq = item.seq
        if item.num_new_tokens != 1 or not seq.is_decoding:
            continue
        num_tokens = seq.num_tokens  # each draft kept adds a token past the one sampled anyway
        limit = min(k, room, seq.params.max_tokens - seq.num_output_tokens - 1, max_model_len - num_tokens - 1)
        if long_rope_from is not None and num_tokens <= long_rope_from:
            limit = min(limit, long_rope_from - num_tokens)
        drafts = proposer.propose(seq, limit) if limit > 0 else ()
        if drafts and seq.params.constraint is not None and valid is not None:
            drafts = drafts[:valid(seq, drafts)]
        if drafts and blocks.try_grow(seq, num_tokens + len(drafts)):
            items[i] = ScheduledSeq(seq, 1 + len(drafts), drafts)
            room -= len(drafts)
    return Plan(tuple(items), plan.preempted)
