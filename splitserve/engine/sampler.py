"""Turns one row of logits per sequence into its next token: banned tokens (`token_bans`),
penalties and biases (`penalties`), then greedy, or temperature / top-k / top-p / min-p (`token_filters`).

All rows are processed together; only seeded rows touch Python one by one, to draw their
uniform on the host from a generator set for their seed and output position. Random rows sample
by inverse CDF: one uniform per row and a `searchsorted` over the cumulative probabilities, so the
noise is one number per row, not per token; on CUDA, from KERNEL_ROWS of them, one kernel draws
them all (`triton_sampling`).

Numerically safe whatever the logits hold: NaN counts as -inf, +inf as the largest float, a row
is shifted by its maximum before it is divided by the temperature (so nothing overflows and the
top token keeps probability > 0), a row with no finite logit is sampled greedily, and every id
returned is in [0, vocab).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from splitserve.engine.grammar import GrammarMasks
from splitserve.engine.model.triton_dispatch import runs_kernels
from splitserve.engine.penalties import Penalties
from splitserve.engine.sequence import Sequence
from splitserve.engine.step_inputs import upload_list
from splitserve.engine.token_bans import TokenBans
from splitserve.engine.token_filters import filter_tokens

_GOLDEN_64 = 0x9E3779B97F4A7C15  # 2**64 / the golden ratio, odd: seed -> seed x this spreads every bit
# random rows a step from which CUDA draws through `triton_sampling`'s kernel. An estimate until
# bench_sampler.py measures it on a GPU: a row takes the kernel about 0.5 ms of one multiprocessor
# with top-p, 40 us without filters (its compiled loops), torch's sort about 18 us a row at 128 rows
# of 131k values (vLLM's published figures); below it the torch path's passes, each spread over the
# whole GPU, are as fast
KERNEL_ROWS = 32


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float | None  # log_softmax of the raw logits; None unless params.logprobs is set
    top_logprobs: dict[int, float] | None  # the params.logprobs most likely tokens, same scale

    @property
    def logprobs(self) -> dict[int, float] | None:
        """{token id: logprob} for the top tokens and the sampled one; None unless requested."""
        if self.logprob is None:
            return None
        return {**(self.top_logprobs or {}), self.token_id: self.logprob}


@dataclass(frozen=True)
class Drawn:
    """A batch's draws, still on the device: `read` is the step's one wait for it."""

    token_ids: torch.Tensor
    raw_logprobs: torch.Tensor | None
    seqs: list[Sequence]

    def read(self) -> list[SampledToken]:
        return _results(self.token_ids, self.raw_logprobs, self.seqs)


class Sampler:
    """Samples a batch. A seeded request's draws depend on its seed and positions alone, not on the
    rest of the batch; `forget` drops a request's grammar state when it ends.
    Constrained requests (structured output) are masked by the `GrammarMasks` that `grammar`
    builds on first use."""

    def __init__(self, seed: int = 0, grammar: Callable[[], GrammarMasks] | None = None) -> None:
        self._seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}
        self._seeded = torch.Generator()  # set anew for every seeded draw
        self._grammar_factory = grammar
        self._grammar: GrammarMasks | None = None
        self._penalties = Penalties()
        self._bans = TokenBans()

    @property
    def grammar(self) -> GrammarMasks:
        if self._grammar is None:
            if self._grammar_factory is None:
                raise ValueError("this sampler has no tokenizer to build structured-output masks with")
            self._grammar = self._grammar_factory()
        return self._grammar

    def forget(self, seq_id: str) -> None:
        if self._grammar is not None:
            self._grammar.forget(seq_id)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence],
               drafts: list[tuple[int, ...]] | None = None) -> list[SampledToken]:
        return self.draw(logits, seqs, drafts).read()

    def draw(self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[tuple[int, ...]] | None = None) -> Drawn:
        """The batch's tokens chosen on the device, a row each; nothing is read back until `Drawn.read`.
        With `drafts` (aligned with `seqs`; `speculation`), a sequence has a row more for each of its
        drafts, sampled as its next output position would be once the drafts before it are kept
        (its min_tokens, penalties, bad words and grammar as well)."""
        offsets, row_drafts = [0] * len(seqs), None
        if drafts is not None and any(drafts):
            seqs, offsets, row_drafts = _rows(seqs, drafts)
        if logits.dim() != 2 or logits.shape[0] != len(seqs):
            raise ValueError(f"logits must have shape [rows={len(seqs)}, vocab], got {tuple(logits.shape)}")
        logits = sanitized_logits(logits.float())
        wants_logprobs = any(s.params.logprobs is not None for s in seqs)
        raw_logprobs = _logprobs(logits) if wants_logprobs else None
        drafted = None if row_drafts is None else [d[:o] for d, o in zip(row_drafts, offsets)]  # before each row
        logits = _mask_stop_tokens(logits, seqs, offsets)
        logits = self._penalties.apply(self._bans.apply(logits, seqs, drafted), seqs, drafted)
        if any(s.params.constraint is not None for s in seqs):
            logits = self.grammar.apply(logits, seqs, offsets, row_drafts)
        token_ids = logits.argmax(dim=-1)
        random_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if random_rows:  # decided on the device, so reading the ids back is the step's only wait for them
            self._sample_random(logits, token_ids, random_rows, [seqs[i] for i in random_rows],
                                [offsets[i] for i in random_rows])
        return Drawn(token_ids, raw_logprobs, seqs)

    def _sample_random(self, logits: torch.Tensor, token_ids: torch.Tensor, random_rows: list[int],
                       seqs: list[Sequence], offsets: list[int]) -> None:
        """Draws token_ids' random rows (a row with no finite logit keeps its greedy id): through
        one kernel on CUDA from KERNEL_ROWS rows, else torch."""
        device = logits.device
        rows = upload_list(random_rows, torch.long, device)
        temperatures = upload_list([s.params.temperature for s in seqs], torch.float32, device)
        filters = [s.params.top_k for s in seqs], [s.params.top_p for s in seqs], [s.params.min_p for s in seqs]
        uniforms = self._uniforms(seqs, offsets, device)
        if runs_kernels(logits) and len(seqs) >= KERNEL_ROWS:
            from splitserve.engine import triton_sampling

            triton_sampling.draw(logits, rows, temperatures, *filters, uniforms, token_ids)
            return
        picked = logits[rows]
        shifted = picked - picked.amax(dim=-1, keepdim=True)  # <= 0, the row's top token at 0
        probs = filter_tokens(shifted / temperatures.unsqueeze(1), *filters).softmax(dim=-1)
        # A token of probability 0 takes its predecessor's cdf: CUDA sums a single row (CUB's scan)
        # in another order than its own rounding of each step, so a 0 there may step the sum up.
        cdf = torch.where(probs > 0, probs.cumsum(dim=-1), 0.0).cummax(dim=-1).values
        # u in (0, 1] scaled to the row's total picks the first token whose cdf reaches it, so a
        # token of probability 0 is never chosen; rounding can put the target past the last cdf
        # value, hence the clamp.
        targets = uniforms.mul_(cdf[:, -1])
        sampled = torch.searchsorted(cdf, targets.unsqueeze(1)).squeeze(1).clamp_(max=logits.shape[1] - 1)
        token_ids[rows] = torch.where(torch.isfinite(picked).any(dim=-1), sampled, token_ids[rows])

    def _uniforms(self, seqs: list[Sequence], offsets: list[int], device: torch.device) -> torch.Tensor:
        """One draw in (0, 1] per row. A seeded row's draw is a function of its seed and the output
        position it samples (its sequence's next, past `offsets` drafts), so a request gives the same
        tokens whichever workers run which of its tokens (a prompt worker the first, a token worker
        the rest; a failover's resumed attempt), with drafts or without."""
        u = torch.rand(len(seqs), device=device, generator=self._shared_generator(device))
        rows = [i for i, seq in enumerate(seqs) if seq.params.seed is not None]
        if rows:  # drawn on the host whatever the device: the same draws on CPU and GPU workers, one upload
            draws = [self._seeded_draw(seqs[i].params.seed,
                                       seqs[i].params.resumed_tokens + seqs[i].num_output_tokens + offsets[i])
                     for i in rows]
            u[upload_list(rows, torch.long, device)] = upload_list(draws, u.dtype, device)
        return u.neg_().add_(1)

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        if device not in self._shared:
            self._shared[device] = torch.Generator(device=device).manual_seed(self._seed)
        return self._shared[device]

    def _seeded_draw(self, seed: int, position: int) -> float:
        """The uniform in [0, 1) of (seed, output position): a CPU generator set by a multiplicative
        hash, so its low 32 bits (all it keeps) differ between positions and between nearby seeds."""
        return torch.rand(1, generator=self._seeded.manual_seed((seed * _GOLDEN_64 + position) % 2**64)).item()


def sanitized_logits(logits: torch.Tensor) -> torch.Tensor:
    """NaN -> -inf (never chosen), +inf -> the largest float (chosen, without NaNs in a softmax).
    Unconditional: asking whether a row needs it would wait for the device."""
    return torch.nan_to_num(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max, neginf=float("-inf"))


def _logprobs(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax of sanitized logits; a row with no finite logit (all NaN) gives -inf, not NaN."""
    return logits.log_softmax(dim=-1).nan_to_num_(nan=float("-inf"))


def _rows(seqs: list[Sequence], drafts: list[tuple[int, ...]]
          ) -> tuple[list[Sequence], list[int], list[tuple[int, ...]]]:
    """Each row's sequence, how many of its drafts come before the row, and those drafts."""
    row_seqs, offsets, row_drafts = [], [], []
    for seq, seq_drafts in zip(seqs, drafts, strict=True):
        row_seqs += [seq] * (1 + len(seq_drafts))
        offsets += range(1 + len(seq_drafts))
        row_drafts += [seq_drafts] * (1 + len(seq_drafts))
    return row_seqs, offsets, row_drafts


def _mask_stop_tokens(logits: torch.Tensor, seqs: list[Sequence], offsets: list[int]) -> torch.Tensor:
    """Sets the stop ids (eos unless ignore_eos) of rows still below min_tokens to -inf."""
    rows, cols, vocab = [], [], logits.shape[1]
    for i, (seq, offset) in enumerate(zip(seqs, offsets)):
        if seq.num_output_tokens + offset < seq.params.min_tokens:
            stop_ids = set(seq.params.stop_token_ids)
            if not seq.params.ignore_eos:
                stop_ids |= seq.eos_token_ids
            ids = [t for t in stop_ids if 0 <= t < vocab]
            rows += [i] * len(ids)
            cols += ids
    if not rows:
        return logits
    logits = logits.clone()
    logits[upload_list(rows, torch.long, logits.device), upload_list(cols, torch.long, logits.device)] = float("-inf")
    return logits


def _results(token_ids: torch.Tensor, raw_logprobs: torch.Tensor | None,
             seqs: list[Sequence]) -> list[SampledToken]:
    ids = token_ids.tolist()
    if raw_logprobs is None:
        return [SampledToken(t, None, None) for t in ids]
    chosen = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1).tolist()
    num_top = min(max(s.params.logprobs or 0 for s in seqs), raw_logprobs.shape[1])  # a vocabulary under 20
    top_values, top_ids = (x.tolist() for x in raw_logprobs.topk(num_top, dim=-1))
    results = []
    for i, seq in enumerate(seqs):
        n = seq.params.logprobs
        if n is None:
            results.append(SampledToken(ids[i], None, None))
        else:
            top = dict(zip(top_ids[i][:n], top_values[i][:n]))
            results.append(SampledToken(ids[i], chosen[i], top))
    return results
