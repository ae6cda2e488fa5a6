"""Speculative decoding by n-gram lookup (engine/speculation.py): the proposer against a plain scan of
the rule, the step's bookkeeping, and generation with drafts against transformers (greedy) and
against the same engine decoding a token at a time (seeded sampling, logprobs, every way a request
stops, penalties, bad words, allowed ids, min_tokens and grammars over drafts, hand-off, preemption,
async scheduling)."""
from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.engine.config import ConfigError
from splitserve.engine.engine_config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.output_constraint import OutputConstraint
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.sequence import Sequence
from splitserve.engine.speculation import MAX_BACKOFF_STEPS, accepted, speculate
from tests.engine.engine_helpers import ENGINE, GREEDY, PROMPTS, assert_same, handed_off, token_ids
from tests.engine.engine_helpers import one_thread  # noqa: F401  (pytest fixture)
from tests.engine.policy_helpers import make, step
from tests.engine.speculation_helpers import DRAFTS, TEXTS, assert_same_text, generate, proposer, scan
from tests.engine.hf_checkpoints import (  # noqa: F401 (fixtures)
    ENGINE_ARGS,
    EOS,
    PAD,
    prompt_ids,
    tokenizers_by_kind,
    write_checkpoint,
)


# ---- the proposer -------------------------------------------------------------------------
def test_the_longest_ending_wins_then_its_latest_occurrence():
    seq = Sequence("s", [5, 6, 7, 1, 9, 6, 7, 2, 3, 5, 6, 7], SamplingParams())
    assert proposer().propose(seq, 3) == (1, 9, 6)  # [5, 6, 7] occurred at 0; [6, 7] later, at 5
    seq.token_ids += [4, 4, 6, 7]
    assert proposer().propose(seq, 2) == (4, 4)  # [6, 7] ends it: its latest occurrence is at 10
    assert proposer(lo=3).propose(seq, 2) == ()  # [4, 6, 7] never occurred before
    assert proposer().propose(Sequence("t", [1, 2, 3, 4], SamplingParams()), 3) == ()
    loop = Sequence("u", [8, 1, 2, 1, 2, 1, 2], SamplingParams())
    assert proposer(hi=2).propose(loop, 5) == (1, 2, 1, 2, 1)  # two tokens followed [1, 2]: a period of 2


def test_a_match_across_token_boundaries_is_none():
    """The packed bytes of [256, 0] hold those of [1, 0] one byte in: not an occurrence."""
    seq = Sequence("s", [256, 0, 0, 7, 1, 0], SamplingParams())
    assert proposer(lo=2, hi=2).propose(seq, 3) == ()
    seq.token_ids += [5, 1, 0]
    assert proposer(lo=2, hi=2).propose(seq, 3) == (5, 1, 0)


def test_a_sequence_whose_drafts_all_fail_backs_off_until_one_is_kept():
    seq, lookup = Sequence("s", [1, 2] * 4, SamplingParams()), proposer()

    def drafting(steps: int) -> list[bool]:
        return [bool(lookup.propose(seq, 2)) for _ in range(steps)]

    assert drafting(2) == [True, True]
    waits = []
    for _ in range(6):
        lookup.checked(seq, 2, 0)
        waits.append(drafting(MAX_BACKOFF_STEPS + 1).index(True))
    assert waits == [1, 2, 4, 8, 16, 16] and MAX_BACKOFF_STEPS == 16
    lookup.checked(seq, 2, 1)
    assert drafting(2) == [True, True]


IDS = st.sampled_from([0, 1, 2, 3, 256, 65536, 2**24, 2**32 - 1])  # zero bytes at every offset


@settings(max_examples=300, deadline=None)
@given(st.lists(IDS, min_size=1, max_size=40), st.lists(st.lists(IDS, max_size=6), max_size=5),
       st.integers(1, 3), st.integers(0, 3), st.integers(1, 5))
def test_proposals_follow_the_rule_as_the_sequence_grows(prompt, appended, lo, extra, limit):
    hi, seq, growing = lo + extra, Sequence("s", prompt, SamplingParams()), proposer(lo, lo + extra)
    for tokens in [[], *appended]:
        seq.token_ids += tokens
        assert growing.propose(seq, limit) == scan(seq.token_ids, lo, hi, limit)


def test_accepted_keeps_drafts_while_they_match():
    assert accepted((), [7]) == [7]
    assert accepted((4, 5, 6), [4, 5, 6, 9]) == [4, 5, 6, 9]  # all kept, and the last row's token
    assert accepted((4, 5, 6), [4, 8, 6, 9]) == [4, 8]        # the first that differs replaces its draft
    assert accepted((4, 5, 6), [3, 5, 6, 9]) == [3]


# ---- what a step may add -------------------------------------------------------------------
def decoding(num_blocks: int = 64, **params) -> tuple:
    """A mixed policy whose one sequence decodes, its 11 tokens a loop of [1, 2]; its decode's plan."""
    policy = make("mixed", num_blocks=num_blocks, chunk_token_budget=64, max_num_seqs=8)
    policy.add(Sequence("s", [1, 2] * 5, SamplingParams(**{"max_tokens": 50, **params})))
    step(policy, token=1)
    return policy, policy.schedule()


def drafts_of(plan) -> tuple[int, ...]:
    return plan.scheduled[0].drafts


@pytest.mark.parametrize("limits, expected", [
    ({}, (2, 1, 2, 1)),
    ({"max_tokens": 3}, (2, 1)),           # a step's tokens in all
    ({"max_rows": 2}, (2,)),               # its sampled rows in all (the memory profile's logits)
    ({"max_model_len": 13}, (2,)),         # 1 token to sample + 1 draft: the sequence reaches 13
    ({"long_rope_from": 13}, (2, 1)),      # the token that turns it long comes last
    ({"long_rope_from": 5}, (2, 1, 2, 1)),  # already long
])
def test_a_decode_drafts_within_the_steps_limits(limits, expected):
    policy, plan = decoding()
    args = {"max_tokens": 100, "max_rows": 8, "max_model_len": 100, **limits}
    more = speculate(plan, proposer(k=4), policy.blocks, args["max_tokens"], args["max_rows"],
                     args["max_model_len"], args.get("long_rope_from"))
    assert drafts_of(more) == expected and more.scheduled[0].num_new_tokens == 1 + len(expected)
    policy.blocks.check_integrity()


def test_a_decode_drafts_no_more_than_its_max_tokens_leave_nor_without_free_blocks():
    policy, plan = decoding(max_tokens=3)  # one output so far: 1 to sample, 1 draft
    assert drafts_of(speculate(plan, proposer(k=4), policy.blocks, 100, 8, 100)) == (2,)
    policy, plan = decoding(num_blocks=3)  # 12 token slots: the sampled token's fits, drafts need a block more
    assert speculate(plan, proposer(k=4), policy.blocks, 100, 8, 100) == plan


@pytest.mark.parametrize("field, value", [("num_speculative_tokens", 17), ("num_speculative_tokens", -1),
                                          ("prompt_lookup_min", 0), ("prompt_lookup_max", 1),
                                          ("prompt_lookup_max", 65)])
def test_bad_settings_name_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        EngineConfig(**{field: value})


# ---- against transformers -----------------------------------------------------------------
NEW_TOKENS = 40


@torch.inference_mode()
def hf_greedy_until_eos(model, ids: list[int]) -> list[int]:
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=EOS, pad_token_id=PAD)
    return out[0, len(ids):].tolist()


# a window (mistral_window, gemma2), LongRoPE turning long at 48 tokens (phi3_longrope), experts (qwen3_moe)
@pytest.mark.parametrize("name", ["llama3_gqa_tied", "mistral_window", "gemma2", "phi3_longrope", "qwen3_moe"])
def test_greedy_generation_with_drafts_matches_transformers(name, tmp_path, tokenizers_by_kind):
    hf = write_checkpoint(tmp_path, name, tokenizers_by_kind)
    vocab = hf.config.vocab_size
    motifs = [prompt_ids(seed, 7, vocab) for seed in range(3, 9)]
    prompts = [m * 3 + m[:3] for m in motifs] + [prompt_ids(9, 19, vocab)]  # repeats to look up, and none
    expected = [hf_greedy_until_eos(hf, p) for p in prompts]
    # random weights follow their prompts little: looking up single tokens drafts (and keeps) more
    engine = LLMEngine(str(tmp_path), dtype="float32", **ENGINE_ARGS, **DRAFTS, prompt_lookup_min=1)
    outputs, drafted, kept = generate(engine, prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert 0 < kept <= drafted


# ---- against the engine decoding a token at a time ----------------------------------------
def both(prompts: list, params, lookup_min: int = 2, **engine) -> tuple[list, list, int, int]:
    """The outputs decoding a token at a time, with drafts (looking up endings of `lookup_min` tokens
    and more), and how many drafts were checked and kept."""
    alone, _, none = generate(LLMEngine("demo", **{**ENGINE, **engine}), prompts, params)
    assert none == 0
    drafted, checked, kept = generate(LLMEngine("demo", **{**ENGINE, **engine, **DRAFTS,
                                                          "prompt_lookup_min": lookup_min}), prompts, params)
    return alone, drafted, checked, kept


@pytest.mark.parametrize("engine", [{}, {"async_scheduling": True}, {"policy": "prefill_first"}])
def test_seeded_sampling_and_logprobs_are_the_same_with_drafts(engine):
    """A seeded draw depends on its output position alone, so sampling with drafts gives the very tokens
    (the demo model's text is noise: at a low temperature its drafts are kept now and then)."""
    params = [SamplingParams(max_tokens=48, temperature=(0.1, 1.0)[i % 2], top_p=0.95, top_k=40, seed=i,
                             logprobs=2, ignore_eos=True) for i in range(2 * len(TEXTS))]
    alone, drafted, _, kept = both(TEXTS * 2, params, **engine)
    assert_same(drafted, alone)
    assert kept > 0


def test_every_way_to_stop_ends_a_steps_tokens_where_a_token_a_step_would():
    """Stop strings, stop ids and lengths ending a step's tokens midway (taken from the outputs
    themselves), beside requests of every kind."""
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    free = generate(LLMEngine("demo", **ENGINE), TEXTS, greedy)[0]
    texts, ids = [o.outputs[0].text for o in free], [o.outputs[0].token_ids for o in free]
    stops = {0: replace(greedy, stop=(texts[0][20:23],)),  # prompt -> how its output stops
             4: replace(greedy, stop=(texts[4][10:13],), include_stop_str_in_output=True),
             2: replace(greedy, stop_token_ids=(ids[2][17],)), 3: replace(greedy, stop_token_ids=(ids[3][9],),
                                                                              min_tokens=12)}
    others = [replace(greedy, max_tokens=1), replace(greedy, max_tokens=2), replace(greedy, max_tokens=3),
              replace(greedy, frequency_penalty=0.5), replace(greedy, logit_bias=((ord("x"), 5.0),)),
              replace(greedy, bad_words=("la",)), replace(greedy, temperature=1.0, seed=3),
              replace(greedy, ignore_eos=False, constraint=OutputConstraint("regex", "[a-z ]{5,20}")),
              replace(greedy, min_tokens=30), greedy]
    prompts = [TEXTS[i] for i in stops] + [TEXTS[i % len(TEXTS)] for i in range(len(others))]
    alone, drafted, _, kept = both(prompts, [*stops.values(), *others])
    assert_same_text(drafted, alone)
    assert kept > 0
    assert [o.finish_reason for o in alone[:len(stops)]] == ["stop"] * len(stops)
    assert all(len(o.outputs[0].token_ids) < 40 for o in alone[:len(stops)])


def free_outputs() -> tuple[list[str], list[list[int]]]:
    """The demo model's greedy texts and ids for TEXTS."""
    free = generate(LLMEngine("demo", **ENGINE), TEXTS, SamplingParams(temperature=0.0, max_tokens=40,
                                                                       ignore_eos=True))[0]
    return [o.outputs[0].text for o in free], [o.outputs[0].token_ids for o in free]


@pytest.mark.parametrize("option", ["penalties", "bias", "bad_words", "allowed", "min_tokens"])
def test_what_follows_the_tokens_before_takes_the_drafts_before_a_row_as_kept(option):
    """Penalties' counts, bad words' prefixes, min_tokens' ban on EOS: each row's as if the drafts
    before it were kept; a bias and allowed ids alike on every row. The same tokens and logprobs."""
    texts, ids = free_outputs()
    firsts = {out[0] for out in ids}  # tokens the outputs began with
    options = {"penalties": dict(repetition_penalty=1.02, frequency_penalty=0.01, presence_penalty=0.01),
               "bias": dict(logit_bias=tuple((t, -100.0) for t in firsts)),
               "bad_words": dict(bad_words=(texts[5][:2], texts[4][8:10])),  # words the outputs had
               "allowed": dict(allowed_token_ids=tuple(t for t in range(257) if t not in firsts)),
               "min_tokens": dict(min_tokens=30, stop_token_ids=tuple(firsts))}[option]  # banned until 30
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": 40, "ignore_eos": True, "logprobs": 2, **options})
    alone, drafted, checked, kept = both(TEXTS, params, lookup_min=1)
    assert_same(drafted, alone)
    assert_same_text(drafted, alone)
    assert checked >= kept > 0
    without = replace(params, **{k: getattr(SamplingParams(), k) for k in options})
    assert token_ids(alone) != token_ids(generate(LLMEngine("demo", **ENGINE), TEXTS, without)[0])


def test_structured_output_drafts_within_its_grammar():
    """A grammar that forces repeats: each row masked as the drafts before it leave the matcher, so
    drafts are kept; one that leaves the model a choice among repeats; JSON. The same text as
    decoding a token at a time, and it matches."""
    constraints = [OutputConstraint("regex", "(abc){4,12}"), OutputConstraint("regex", "(ab|ba|aa){3,20}"),
                   OutputConstraint("choice", json.dumps(["yes yes yes yes yes", "no no no no no no"])),
                   OutputConstraint("json_schema", json.dumps({"type": "object", "properties": {
                       "a": {"type": "string", "enum": ["xyzxyzxyzxyz"]}, "b": {"type": "boolean"}},
                       "required": ["a", "b"]}))]
    params = [SamplingParams(temperature=t, seed=3, max_tokens=60, constraint=c)
              for c in constraints for t in (0.0, 1.0)]
    prompts = [TEXTS[i % len(TEXTS)] for i in range(len(params))]
    alone, drafted, _, kept = both(prompts, params)
    assert_same_text(drafted, alone)
    assert kept > 0
    for out, p in zip(alone, params):
        text = out.outputs[0].text
        if p.constraint.kind == "regex":
            assert re.fullmatch(p.constraint.spec, text), text
        elif p.constraint.kind == "choice":
            assert text in json.loads(p.constraint.spec)
        else:
            assert json.loads(text)["a"] == "xyzxyzxyzxyz"


def test_drafts_where_the_cache_runs_short_and_sequences_are_preempted():
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, logprobs=1)
    alone, drafted, _, kept = both(TEXTS, params, num_kv_blocks=14, max_model_len=128)
    assert_same(drafted, alone)
    assert kept > 0


def test_a_token_engine_drafts_after_a_hand_off():
    assert_same(handed_off(GREEDY, **DRAFTS), handed_off(GREEDY), skip_first_logprob=True)


def test_drafts_stay_within_the_rows_the_memory_profile_ran():
    """At most max_num_seqs sampled rows a step (the memory profile's logits): two sequences of at
    most three draft one token a step between them, one alone two."""
    engine = LLMEngine("demo", max_num_seqs=3, **ENGINE, **DRAFTS)
    rows, draw = [], engine.sampler.draw
    engine.sampler.draw = lambda logits, *args: rows.append(logits.shape[0]) or draw(logits, *args)
    for i, prompt in enumerate(PROMPTS[:2]):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert max(rows) == 3
