"""A cluster config's tensor parallelism in the simulator: each pool's perf model, KV budget and
CLS speeds come from its own tensor_parallel_size; a TP-1 pool stands in for the target's TP."""
import pytest

from splitserve.bench.workload import RequestSpec
from splitserve.config import ClusterConfig
from splitserve.placement import Role
from splitserve.placement.hardware import HARDWARE_CLASSES
from splitserve.sim.cluster import Simulation
from splitserve.engine.demo import demo_model_config
from splitserve.sim.from_config import SimTarget, perf_model_for, scenario_from_config, shape_of
from splitserve.sim.perf_model import KV_BYTES_PER_TOKEN, load_perf_models
from splitserve.sim.scenario import PoolSpec, Scenario
from tests.sim.test_sim_cli import write_cpu_profile
from tests.sim.test_sim_worker import LinearPerf

PER_TOKEN = KV_BYTES_PER_TOKEN["llama2-70b"]
H100 = HARDWARE_CLASSES["h100"]


def config(*pools: tuple[str, str, int], **rest) -> ClusterConfig:
    return ClusterConfig.model_validate({"pools": [{"role": role, "hardware": hw, "tensor_parallel_size": tp}
                                                   for role, hw, tp in pools], **rest})


def dgx_budget(gpus: int) -> int:
    """What `gpus` GPUs at 90% leave for KV after Llama-2-70B's fp16 weights, in tokens."""
    return int((gpus * 72e9 - 140e9) // PER_TOKEN)


def test_tp_1_pools_stand_in_for_the_target_s_tp_as_before():
    scenario = scenario_from_config(config(("prompt", "h100", 1), ("token", "a100", 1)))
    models = load_perf_models()
    assert dict(scenario.perf_models) == {"h100": models["llama2-70b", "h100-80gb", 8],
                                          "a100": models["llama2-70b", "a100-80gb", 8]}
    assert dict(scenario.hardware) == {"h100": H100, "a100": HARDWARE_CLASSES["a100"]}  # the classes, unscaled
    assert scenario.kv_budget_tokens == dgx_budget(8) and [p.kv_budget_tokens for p in scenario.pools] == [None, None]
    at_4 = scenario_from_config(config(("mixed", "h100", 1)), SimTarget(tensor_parallel=4))
    assert at_4.perf_models["h100"].tensor_parallel == 4 and at_4.kv_budget_tokens == dgx_budget(4)


def test_a_config_scheduling_by_priority_is_simulated_so():
    scenario = scenario_from_config(config(("prompt", "h100", 1), ("token", "a100", 1),
                                           engine={"scheduling_policy": "priority"},
                                           scheduler={"background_queue_share": 0.25}))
    assert scenario.limits.by_priority and scenario.thresholds.background_share == 0.25
    assert not scenario_from_config(config(("mixed", "h100", 1))).limits.by_priority


def test_pools_of_one_class_at_different_tp_keep_their_own_models_budgets_and_speeds():
    scenario = scenario_from_config(config(("prompt", "h100", 4), ("token", "h100", 8), ("mixed", "h100", 1)),
                                    SimTarget(tensor_parallel=4))
    assert {key: model.tensor_parallel for key, model in scenario.perf_models.items()} == \
        {"h100/tp4": 4, "h100/tp8": 8, "h100": 4}
    assert [scenario.kv_budget_tokens_of(p) for p in scenario.pools] == [dgx_budget(4), dgx_budget(8), dgx_budget(4)]
    profiles = scenario.hardware_profiles()
    assert profiles["h100/tp4"] == H100.with_tensor_parallel(4) and profiles["h100"] is H100
    simulation = Simulation(scenario, [RequestSpec(0, 0.0, 100, 10)])
    blocks = {w.worker_id: w.blocks.num_blocks for w in simulation.workers.values()}
    assert blocks == {"prompt-000": dgx_budget(4) // 16, "token-000": dgx_budget(8) // 16,
                      "mixed-000": dgx_budget(4) // 16}
    assert simulation.cls.workers["token-000"].hardware == H100.with_tensor_parallel(8)
    assert {w.hardware for w in simulation.run().workers} == {"h100"}  # reports name the class


def test_an_explicit_kv_budget_is_each_rank_s_bytes():
    """engine.kv_cache_memory_bytes is a rank's: a TP-4 worker holds 4x its tokens, a TP-1 pool
    standing in for the target's DGX 8x."""
    scenario = scenario_from_config(config(("prompt", "h100", 4), ("token", "h100", 1),
                                           engine={"kv_cache_memory_bytes": 2 ** 35}))
    assert [scenario.kv_budget_tokens_of(p) for p in scenario.pools] == [4 * 2 ** 35 // PER_TOKEN,
                                                                         8 * 2 ** 35 // PER_TOKEN]


def test_a_host_tier_in_bytes_is_each_rank_s():
    scenario = scenario_from_config(config(("prompt", "h100", 1), ("token", "h100", 4),
                                           engine={"kv_host_cache_bytes": 2 ** 36}))
    assert scenario.host_kv.tokens == 8 * 2 ** 36 // PER_TOKEN
    prompt, token = map(scenario.host_tier_of, scenario.pools)
    assert prompt.blocks == 8 * 2 ** 36 // PER_TOKEN // 16 and prompt.block_s == pytest.approx(16 * PER_TOKEN / 400e9)
    assert token.blocks == 4 * 2 ** 36 // PER_TOKEN // 16 and token.write_through  # the engine's default
    back = scenario_from_config(config(("prompt", "h100", 1), ("token", "h100", 1), engine={
        "kv_host_cache_bytes": 2 ** 36, "kv_host_write_policy": "write_back"}))
    assert not back.host_tier_of(back.pools[0]).write_through
    assert scenario_from_config(config(("prompt", "h100", 1), ("token", "h100", 1))).host_kv is None


def test_a_rank_of_a_model_with_fewer_kv_heads_than_ranks_holds_a_whole_head(tmp_path):
    """The demo model's 4 KV heads at TP 8: each rank repeats one, so 4 ranks' bytes hold a token."""
    profile = tmp_path / "cpu.csv"
    write_cpu_profile(profile, tensor_parallel=8)
    per_token = shape_of(demo_model_config(), 4).kv_bytes_per_token
    scenario = scenario_from_config(config(("mixed", "cpu", 8), engine={"kv_cache_memory_bytes": 2 ** 24}),
                                    SimTarget("demo", 1, profile))
    assert scenario.kv_budget_tokens_of(scenario.pools[0]) == 4 * 2 ** 24 // per_token


def test_an_fp8_kv_cache_holds_twice_the_tokens_and_sends_half_the_bytes():
    """The same GPUs and weights as bf16 KV; transfers of a byte a K or V value."""
    fp8 = config(("prompt", "h100", 1), ("token", "h100", 1), engine={"kv_cache_dtype": "fp8"})
    scenario = scenario_from_config(fp8)
    assert scenario.kv_budget_tokens == int((8 * 72e9 - 140e9) // (PER_TOKEN // 2))
    assert scenario.transfer.kv_bytes_per_token == PER_TOKEN // 2
    bf16 = config(("prompt", "h100", 1), ("token", "h100", 1))
    assert scenario_from_config(bf16).transfer.kv_bytes_per_token == PER_TOKEN


@pytest.mark.parametrize("pools, target, message", [
    ((("prompt", "h100", 16), ("token", "a100", 8)), SimTarget(),
     r"the prompt pool \(h100, tensor_parallel_size 16\) has no performance profile for .*'h100-80gb', 16\)"),
    ((("mixed", "a100", 4),), SimTarget(model="bloom-176b"),
     r"the mixed pool \(a100, tensor_parallel_size 4\) has no performance profile for .*'bloom-176b', 'a100-80gb'"),
])
def test_no_profile_rows_for_a_pool_s_tp_is_an_error_naming_the_pool(pools, target, message):
    with pytest.raises(ValueError, match=message):
        scenario_from_config(config(*pools), target)


@pytest.mark.parametrize("tp", [0, -8])
def test_a_target_tp_below_1_is_refused(tp):
    with pytest.raises(ValueError, match=f"tensor_parallel \\(--tensor-parallel\\) must be an integer >= 1, got {tp}"):
        SimTarget(tensor_parallel=tp)


def test_a_pool_whose_tp_leaves_no_room_for_the_kv_cache_is_named():
    with pytest.raises(ValueError, match="the token pool's kv_budget_tokens=.* fewer tokens than max_model_len"):
        scenario_from_config(config(("prompt", "h100", 8), ("token", "h100", 2)))  # 144 GB for 140 GB of weights


def test_a_measured_profile_serves_tp_1_pools_and_only_its_own_tp_otherwise(tmp_path):
    profile = tmp_path / "cpu.csv"
    write_cpu_profile(profile)  # rows at tensor_parallel 1
    target = SimTarget("demo", 8, profile)  # the stand-in TP is for the paper's profiles only
    scenario = scenario_from_config(config(("mixed", "cpu", 1)), target)
    assert scenario.perf_models["cpu"].tensor_parallel == 1 and scenario.kv_windows == (None,)
    with pytest.raises(ValueError, match=r"the mixed pool \(cpu, tensor_parallel_size 2\).*\('demo', 'cpu', 2\)"):
        scenario_from_config(config(("mixed", "cpu", 2)), target)


def test_a_measured_profile_of_several_models_gives_the_targets_rows(tmp_path):
    """The profile's `model` column picks the rows (the first model's rows were taken, whatever it was)."""
    profile = tmp_path / "two.csv"
    write_cpu_profile(profile)
    demo_rows = profile.read_text().splitlines()[1:]
    slow = [row.replace("demo,", "other,", 1) for row in demo_rows]
    profile.write_text("\n".join([profile.read_text().splitlines()[0], *slow, *demo_rows]) + "\n")
    pool = config(("mixed", "cpu", 1)).pools[0]
    for model in ("demo", "other"):
        assert perf_model_for(pool, SimTarget(model, 1, profile)).model == model
    with pytest.raises(ValueError, match=r"several models \(demo, other\) and none of 'llama'"):
        perf_model_for(pool, SimTarget("llama", 1, profile))


def test_pool_specs_key_their_setup_by_tp():
    assert PoolSpec(Role.PROMPT, 1, "h100").setup == "h100"
    assert PoolSpec(Role.PROMPT, 1, "h100", 8).setup == "h100/tp8"
    with pytest.raises(ValueError, match="tensor_parallel of the prompt pool"):
        PoolSpec(Role.PROMPT, 1, "h100", 0)
    with pytest.raises(ValueError, match="no model for hardware hw/tp2"):
        Scenario((PoolSpec(Role.MIXED, 1, "hw", 2),), {"hw": LinearPerf()}, kv_budget_tokens=4096,
                 max_model_len=2048)


def test_a_models_layer_groups_are_in_its_shape(tmp_path):
    """What the simulated workers' block managers release by (`Scenario.kv_windows`), how many
    blocks their budget holds (`kv_group_share`) and what each layer sends: the engine's layer groups."""
    from splitserve.engine.demo import DEMO_MODEL_CONFIG
    from splitserve.engine.dummy_weights import write_shape_checkpoint
    from splitserve.sim.from_config import model_shape

    mistral = {**DEMO_MODEL_CONFIG, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
               "sliding_window": 64}
    every = model_shape(write_shape_checkpoint(tmp_path / "m", mistral))
    assert (every.kv_windows, every.kv_group_share) == ((64,), 1.0)
    layers = DEMO_MODEL_CONFIG["num_hidden_layers"]
    alternate = model_shape(write_shape_checkpoint(tmp_path / "a", {
        **mistral, "layer_types": ["full_attention", "sliding_attention"] * (layers // 2)}))
    assert (alternate.kv_windows, alternate.kv_group_share) == ((None, 64), 0.5)
    assert alternate.kv_bytes_per_token == every.kv_bytes_per_token  # every layer's KV, whatever its group
    # which group each layer's KV travels with (`TransferModel.layer_groups`)
    assert (every.kv_layer_groups, alternate.kv_layer_groups) == ((0,) * layers, (0, 1) * (layers // 2))
    for plain in (model_shape("demo"), model_shape("llama2-70b")):
        assert (plain.kv_windows, plain.kv_group_share) == ((None,), 1.0)
    assert model_shape("llama2-70b").kv_layer_groups == ()
