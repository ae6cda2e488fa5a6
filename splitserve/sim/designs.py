"""The cluster designs of Splitwise (IV-D, VI): two baselines and four Splitwise variants, each a
function (num_prompt, num_token) -> Scenario, with the per-machine (DGX) cost and power constants
of the Splitwise provisioning analysis (Patel et al., ISCA '24, VI; splitwise-sim's configs).

Baselines run mixed workers only, placed by JSQ; their machine count is `num_prompt` and `num_token`
must be 0. Splitwise designs have a prompt pool and a token pool placed by the `splitwise` policy.
Mixed machines (every baseline machine, and a Splitwise machine while in the mixed pool) run
`mixed_policy`: by default `orca`, the paper's mixed continuous batching (IV-A, VI-A: whole prompts
batched with the running decodes under 2048 tokens, as splitwise-sim's instances do). Not
Sarathi-Serve's chunks (`mixed`), which keep prompts from stalling decodes and make a much stronger
baseline, nor vLLM's original `prefill_first`, which stalls every decode for every prompt; both
are there to show what the batching changes.
"h100-80gb-pcap" is the power-capped H100 of the CSV.

`decode_rule` picks the iteration-time model: "context" (ours, `PerfModel`: each decoding sequence
pays for its KV context) or "splitwise-sim" (`SplitwiseSimPerf`: that simulator's rule, with which
the paper's numbers were made), so the reproduction can show what the rule changes.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from splitserve.placement import Role
from splitserve.sim.perf_model import MODEL_SHAPES, PerfModel, load_perf_models
from splitserve.sim.scenario import PoolSpec, Scenario
from splitserve.sim.splitwise_decode import SplitwiseSimPerf, load_splitwise_sim_models
from splitserve.sim.transfer import TransferModel

MIXED_POLICIES = ("orca", "prefill_first", "mixed")  # the first is the paper's; mixed is Sarathi-Serve
A100, H100, H100_CAP = "a100-80gb", "h100-80gb", "h100-80gb-pcap"
COST = {A100: 2.21, H100: 4.76, H100_CAP: 4.76}     # relative $/h per DGX
POWER = {A100: 24.8, H100: 44.0, H100_CAP: 30.8}    # relative power per DGX (pcap: 0.7 x 44)
DEFAULT_MODEL, TENSOR_PARALLEL = "llama2-70b", 8
DECODE_RULES = ("context", "splitwise-sim")
GPU_BYTES, GPUS_PER_MACHINE, KEPT_BACK = 80e9, 8, 0.1


@dataclass(frozen=True)
class Design:
    """A design: baselines have one mixed pool on `prompt_hw`; Splitwise designs a prompt pool on
    `prompt_hw` and a token pool on `token_hw`."""

    name: str
    prompt_hw: str
    token_hw: str
    baseline: bool
    decode_rule: str = "context"
    mixed_policy: str = MIXED_POLICIES[0]  # how mixed machines batch

    def __post_init__(self) -> None:
        if self.decode_rule not in DECODE_RULES:
            raise ValueError(f"decode_rule must be one of {', '.join(DECODE_RULES)}, got {self.decode_rule!r}")
        if self.mixed_policy not in MIXED_POLICIES:
            raise ValueError(f"mixed_policy must be one of {', '.join(MIXED_POLICIES)}, got {self.mixed_policy!r}")

    def cost(self, num_prompt: int, num_token: int) -> float:
        return num_prompt * COST[self.prompt_hw] + num_token * COST[self.token_hw]

    def power(self, num_prompt: int, num_token: int) -> float:
        return num_prompt * POWER[self.prompt_hw] + num_token * POWER[self.token_hw]

    def scenario(self, num_prompt: int, num_token: int, model: str = DEFAULT_MODEL) -> Scenario:
        """The cluster of this design with `num_prompt` prompt (baselines: mixed) and `num_token` token machines."""
        if self.baseline and num_token != 0:
            raise ValueError(f"num_token must be 0 for {self.name} (a baseline has mixed machines only), "
                             f"got {num_token}")
        if num_prompt < 1 or (not self.baseline and num_token < 1):
            raise ValueError(f"num_prompt and num_token of {self.name} must be >= 1 "
                             f"(baselines: num_token 0), got {num_prompt}, {num_token}")
        if model not in MODEL_SHAPES:
            raise ValueError(f"model must be one of {', '.join(MODEL_SHAPES)}, got {model!r}")
        if self.baseline:
            pools = (PoolSpec(Role.MIXED, num_prompt, self.prompt_hw),)
        else:
            pools = (PoolSpec(Role.PROMPT, num_prompt, self.prompt_hw), PoolSpec(Role.TOKEN, num_token, self.token_hw))
        shape = MODEL_SHAPES[model]
        return Scenario(pools=pools, perf_models={p.hardware: perf_model(model, p.hardware, self.decode_rule)
                                                    for p in pools},
                        kv_budget_tokens=kv_budget_tokens(model),
                        placement="jsq" if self.baseline else "splitwise",
                        transfer=TransferModel(kv_bytes_per_token=shape.kv_bytes_per_token,
                                               num_layers=shape.num_layers),
                        role_policies={Role.MIXED.value: self.mixed_policy})


DESIGNS = {d.name: d for d in (
    Design("baseline-a100", A100, A100, True),
    Design("baseline-h100", H100, H100, True),
    Design("splitwise-aa", A100, A100, False),
    Design("splitwise-hh", H100, H100, False),
    Design("splitwise-ha", H100, A100, False),
    Design("splitwise-hhcap", H100, H100_CAP, False),
)}


def design(name: str) -> Design:
    if name not in DESIGNS:
        raise ValueError(f"design must be one of {', '.join(DESIGNS)}, got {name!r}")
    return DESIGNS[name]


def kv_budget_tokens(model: str) -> int:
    """KV cache per DGX in tokens: 8 x 80 GB, 10% kept back, less the fp16 weights (as bench_sim)."""
    shape = MODEL_SHAPES[model]
    weights = {"llama2-70b": 140e9, "bloom-176b": 329e9}[model]
    return int((GPUS_PER_MACHINE * GPU_BYTES * (1 - KEPT_BACK) - weights) / shape.kv_bytes_per_token)


@cache
def perf_model(model: str, hardware: str, decode_rule: str = "context") -> PerfModel | SplitwiseSimPerf:
    """The packaged profile's model of `model` on one TP8 DGX of `hardware`, under `decode_rule`."""
    models = load_splitwise_sim_models() if decode_rule == "splitwise-sim" else load_perf_models()
    return models[model, hardware, TENSOR_PARALLEL]
