"""The cluster-config schema and the Serve config files in deploy/.

References: Ray Serve's own config-file schema (`ServeDeploySchema`), Ray's actor-option
validation (`ray.remote(...).options(...)`) and Ray's accelerator-type names. Nothing here starts
Ray: `build_app` only validates and binds.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import ray
import ray.util.accelerators
import yaml
from pydantic import ValidationError
from ray import serve
from ray.serve.schema import ServeDeploySchema

from splitserve.cluster.app import build_app
from splitserve.config import APP_IMPORT_PATH, ClusterConfig, load_cluster_config
from splitserve.config.options import WorkerResources
from splitserve.engine.config import ConfigError
from splitserve.engine.demo import demo_model_config
from splitserve.placement.hardware import HARDWARE_CLASSES, HardwareProfile
from splitserve.placement.state import AdapterOptions, PrefixOptions

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DEPLOY_FILES = sorted(DEPLOY.glob("*.yaml"))
GPU_FILES = ("splitwise-ha.yaml", "splitwise-hhcap.yaml", "baseline.yaml")
RAY_ACCELERATOR_TYPES = {v for k, v in vars(ray.util.accelerators).items() if k.isupper() and isinstance(v, str)}


def header(path: Path) -> str:
    """The comment lines a file starts with."""
    lines = path.read_text().splitlines()
    return "\n".join(line for line in lines[:next(i for i, line in enumerate(lines) if not line.startswith("#"))])


def roles(config: ClusterConfig) -> dict:
    return {pool.role: pool for pool in config.pools}


class _Actor:
    pass


# ---------------------------------------------------------------------------------------------
# deploy/*.yaml
# ---------------------------------------------------------------------------------------------

def test_the_deploy_files_are_there():
    assert {p.name for p in DEPLOY_FILES} >= {"local-cpu.yaml", *GPU_FILES}


@pytest.mark.parametrize("path", DEPLOY_FILES, ids=lambda p: p.name)
def test_deploy_file_is_a_serve_config_of_the_splitserve_app(path):
    raw = yaml.safe_load(path.read_text())
    ServeDeploySchema.model_validate(raw)  # what `serve run` / `serve deploy` accept
    [app] = raw["applications"]
    assert (app["name"], app["route_prefix"], app["import_path"]) == ("splitserve", "/", APP_IMPORT_PATH)
    config, http = load_cluster_config(path)
    assert config == ClusterConfig.model_validate(app["args"])
    assert isinstance(http["host"], str) and http["port"] == 8000
    ray_was_up = ray.is_initialized()  # the Ray tests' cluster may be up; build_app must not start one
    built = build_app(app["args"])
    assert isinstance(built, serve.Application) and ray.is_initialized() == ray_was_up


@pytest.mark.parametrize("path", DEPLOY_FILES, ids=lambda p: p.name)
def test_deploy_file_header_says_how_to_run_it(path):
    text = header(path)
    relative = f"deploy/{path.name}"
    for command in (f"splitserve serve --config {relative}", f"serve run {relative}", f"serve deploy {relative}"):
        assert command in text, command
    assert len(text.splitlines()) >= 8  # the design, not just the commands


@pytest.mark.parametrize("path", DEPLOY_FILES, ids=lambda p: p.name)
def test_pool_resources_are_valid_ray_actor_options(path):
    config, _ = load_cluster_config(path)
    gpu = path.name in GPU_FILES
    for pool in config.pools:
        options = pool.resources.ray_options()
        ray.remote(_Actor).options(**options)  # raises ValueError on an option Ray rejects
        assert (options["num_gpus"] >= 1) is gpu and (pool.hardware != "cpu") is gpu
        assert options.get("accelerator_type") in (RAY_ACCELERATOR_TYPES if gpu else {None})
        for name in pool.resources.resources:  # custom resources: GPU files only, explained there
            assert gpu and name in header(path), name
    if gpu:  # Splitwise's Llama-2-70B at TP 8: one GPU per rank
        assert config.engine.dtype == "bfloat16" and config.engine.device == "cuda"
        assert "PLACEHOLDER" in path.read_text() and config.model.startswith("/")
        assert config.model.endswith("Llama-2-70b-hf")
        assert [(p.tensor_parallel_size, p.resources.num_gpus) for p in config.pools] == [(8, 1)] * len(config.pools)


def test_local_cpu_is_the_default_cluster():
    config, http = load_cluster_config(DEPLOY / "local-cpu.yaml")
    assert http == {"host": "127.0.0.1", "port": 8000}
    assert config.transfer.backend == "gloo"  # what the default `auto` picks for CPU workers
    without_backend = {"transfer": {"backend"}}
    assert config.model_dump(exclude=without_backend) == ClusterConfig().model_dump(exclude=without_backend)
    assert [(p.role, p.hardware, p.num_workers, p.resources.ray_options()) for p in config.pools] == \
        [(role, "cpu", 1, {"num_cpus": 1.0, "num_gpus": 0.0}) for role in ("prompt", "token")]


def test_priority_scheduling_reaches_the_engines_the_requests_and_placement():
    config = ClusterConfig.model_validate({"engine": {"scheduling_policy": "priority"}, "batch": {"priority": 1},
                                           "scheduler": {"background_queue_share": 0.3}})
    assert all(config.engine_config(role).scheduler_limits(64).by_priority for role in ("prompt", "token", "mixed"))
    assert config.request_limits().priorities and config.batch.priority == 1
    assert config.scheduler.thresholds().background_share == 0.3
    assert ClusterConfig().scheduler.thresholds().background_share == 0.5


@pytest.mark.parametrize("name, prompt_hw, token_hw, token_gpu", [
    ("splitwise-ha.yaml", "h100", "a100", "A100"),
    ("splitwise-hhcap.yaml", "h100", "h100-cap", "H100"),
])
def test_splitwise_designs(name, prompt_hw, token_hw, token_gpu):
    config, _ = load_cluster_config(DEPLOY / name)
    pools = roles(config)
    assert set(pools) == {"prompt", "token"}
    assert (pools["prompt"].hardware, pools["prompt"].resources.accelerator_type) == (prompt_hw, "H100")
    assert (pools["token"].hardware, pools["token"].resources.accelerator_type) == (token_hw, token_gpu)
    assert config.transfer.backend == "nccl" and config.scheduler.policy == "splitwise"
    if pools["prompt"].resources.accelerator_type == token_gpu:  # same GPUs: custom resources tell nodes apart
        assert not set(pools["prompt"].resources.resources) & set(pools["token"].resources.resources)
        assert pools["prompt"].resources.resources and pools["token"].resources.resources
    assert config.hardware(token_hw) is HARDWARE_CLASSES[token_hw]


def test_baseline_is_mixed_only_and_vllm_style():
    config, _ = load_cluster_config(DEPLOY / "baseline.yaml")
    assert [p.role for p in config.pools] == ["mixed"] and config.pools[0].num_workers >= 2
    assert config.engine.mixed_policy == "prefill_first"
    assert "Sarathi-Serve" in header(DEPLOY / "baseline.yaml")


# ---------------------------------------------------------------------------------------------
# what the loader accepts
# ---------------------------------------------------------------------------------------------

def write(tmp_path: Path, document) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def test_bare_cluster_config_loads(tmp_path):
    path = write(tmp_path, {"model": "demo", "pools": [{"role": "mixed", "num_workers": 3}]})
    config, http = load_cluster_config(path)
    assert http == {} and [(p.role, p.num_workers) for p in config.pools] == [("mixed", 3)]
    assert load_cluster_config(write(tmp_path, None)) == (ClusterConfig(), {})  # an empty file: defaults


def test_serve_file_without_the_splitserve_app_is_a_clear_error(tmp_path):
    other = {"name": "other", "route_prefix": "/", "import_path": "my.app:build"}
    with pytest.raises(ValueError, match=f"one application with import_path {re.escape(APP_IMPORT_PATH)}, found 0"):
        load_cluster_config(write(tmp_path, {"applications": [other]}))
    ours = {"name": "splitserve", "import_path": APP_IMPORT_PATH}
    with pytest.raises(ValueError, match="found 2"):
        load_cluster_config(write(tmp_path, {"applications": [ours, {**ours, "name": "again"}]}))
    config, http = load_cluster_config(write(tmp_path, {"applications": [other, ours]}))  # no args: defaults
    assert config == ClusterConfig() and http == {}


@pytest.mark.parametrize("document, message", [
    (5, "the file must be a mapping, got 5"), ({"applications": None}, "applications must be a list of mappings"),
    ({"applications": "foo"}, "applications must be a list of mappings"),
    ({"applications": ["foo"]}, "applications must be a list of mappings"),
    ({"applications": [], "http_options": "x"}, "http_options must be a mapping, got 'x'")])
def test_a_serve_file_of_the_wrong_shape_is_a_clear_error(tmp_path, document, message):
    with pytest.raises(ValueError, match=message):
        load_cluster_config(write(tmp_path, document))


def test_a_file_that_is_not_yaml_is_a_clear_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("pools: [\n")
    with pytest.raises(ValueError, match="bad.yaml: not valid YAML"):
        load_cluster_config(path)


# ---------------------------------------------------------------------------------------------
# invalid configs name the field
# ---------------------------------------------------------------------------------------------

INVALID = {
    "unknown hardware": ({"pools": [{"role": "mixed", "hardware": "tpu-v5"}]}, r"hardware class 'tpu-v5' is unknown"),
    "prompt without token": ({"pools": [{"role": "prompt"}, {"role": "mixed"}]}, r"prompt pool needs a token pool"),
    "duplicate role": ({"pools": [{"role": "mixed"}, {"role": "mixed"}]}, r"one pool per role.*'mixed', 'mixed'"),
    "no pools": ({"pools": []}, r"at least one pool"),
    "unknown role": ({"pools": [{"role": "decode"}]}, r"pools\.0\.role"),
    "zero workers": ({"pools": [{"role": "mixed", "num_workers": 0}]}, r"pools\.0\.num_workers\n.*greater than or equal to 1"),
    "unknown field": ({"modle": "demo"}, r"modle\n.*Extra inputs are not permitted"),
    "unknown nested field": ({"engine": {"blok_size": 16}}, r"engine\.blok_size\n.*Extra inputs"),
    "engine knob": ({"engine": {"block_size": 0}}, r"engine\n.*block_size must be >= 1, got 0"),
    "engine dtype": ({"engine": {"dtype": "fp8"}}, r"engine\n.*dtype must be auto, float32, bfloat16 or float16"),
    "scheduler policy": ({"scheduler": {"policy": "fifo"}}, r"scheduler\.policy\n.*'round-robin', 'jsq' or 'splitwise'"),
    "transfer backend": ({"transfer": {"backend": "mpi"}}, r"transfer\.backend"),
    "negative gpus": ({"pools": [{"role": "mixed", "resources": {"num_gpus": -1}}]},
                      r"pools\.0\.resources\.num_gpus\n.*greater than or equal to 0"),
    "builtin as custom resource": ({"pools": [{"role": "mixed", "resources": {"resources": {"GPU": 1}}}]},
                                   r"pools\.0\.resources\.resources\n.*'GPU' is not a custom resource"),
    "negative custom resource": ({"pools": [{"role": "mixed", "resources": {"resources": {"x": -2}}}]},
                                 r"resource 'x' must be >= 0"),
    "NaN custom resource": ({"pools": [{"role": "mixed", "resources": {"resources": {"x": float("nan")}}}]},
                            r"pools\.0\.resources\.resources\.x\n.*finite number"),
    "infinite stuck bound": ({"scheduler": {"stuck_step_s": float("inf")}}, r"scheduler\.stuck_step_s\n.*finite"),
    "infinite SLO": ({"slo": {"e2e_s": float("inf")}}, r"slo\.e2e_s\n.*finite number"),
    "engine device": ({"engine": {"device": "tpu"}}, r"engine\n.*device must be auto, cpu, cuda or cuda:N"),
    "engine max_model_len": ({"engine": {"max_model_len": -5}}, r"engine\n.*max_model_len must be >= 1"),
    "engine seed": ({"engine": {"seed": 2**64}}, r"engine\.seed\n.*less than 18446744073709551616"),
    "engine num_kv_blocks": ({"engine": {"num_kv_blocks": 10**11}},
                             r"engine\.num_kv_blocks\n.*less than or equal to 2147483647"),
    "empty api key": ({"ingress": {"api_key": ""}}, r"ingress\.api_key\n.*at least 1 character"),
    "bad custom class": ({"hardware_classes": {"l4": {"prompt_speed": 0, "token_speed": 1}}},
                         r"hardware_classes\.l4\.prompt_speed\n.*greater than 0"),
    "negative saved weight": ({"scheduler": {"prefill_saved_weight": -1}},
                              r"scheduler\.prefill_saved_weight\n.*greater than or equal to 0"),
    "empty prefix index": ({"scheduler": {"prefix_index_blocks": 0}}, r"scheduler\.prefix_index_blocks"),
    "idle polls faster": ({"scheduler": {"report_interval_s": 0.5, "idle_report_interval_s": 0.2}},
                          r"scheduler\n.*idle_report_interval_s \(0\.2\) must be at least report_interval_s \(0\.5\)"),
    "orphans before a poll": ({"scheduler": {"idle_report_interval_s": 5, "orphan_timeout_s": 15}},
                              r"scheduler\n.*orphan_timeout_s \(15\.0\) must be at least 4 x idle_report_interval_s"),
    "orphan timeout too short": ({"scheduler": {"orphan_timeout_s": 1}}, r"scheduler\.orphan_timeout_s\n.*10"),
    "batch priority served first come": ({"batch": {"priority": 1}}, r"batch\.priority: the engines schedule first"),
    "priority with accelgen": ({"engine": {"scheduling_policy": "priority", "mixed_policy": "accelgen"}},
                               r"engine\n.*the accelgen policy orders requests by their latency targets"),
}


@pytest.mark.parametrize("args, message", INVALID.values(), ids=INVALID.keys())
def test_invalid_config_names_the_field(tmp_path, args, message):
    with pytest.raises(ValidationError, match=message):
        ClusterConfig.model_validate(args)
    serve_file = {"applications": [{"name": "splitserve", "import_path": APP_IMPORT_PATH, "args": args}]}
    with pytest.raises(ValidationError, match=message):  # the same through a file
        load_cluster_config(write(tmp_path, serve_file))
    with pytest.raises(ValidationError, match=message):  # and through the Serve builder
        build_app(args)


def test_the_digest_tells_configs_apart():
    """A new CLS adopts only workers whose config digest is its own."""
    assert ClusterConfig().digest() == ClusterConfig.model_validate({}).digest()
    assert ClusterConfig().digest() != ClusterConfig.model_validate({"engine": {"block_size": 32}}).digest()


# ---------------------------------------------------------------------------------------------
# hardware classes and worker resources
# ---------------------------------------------------------------------------------------------

def test_custom_hardware_classes():
    config = ClusterConfig.model_validate({
        "hardware_classes": {"l40s": {"prompt_speed": 0.3, "token_speed": 0.5},
                             "h100": {"prompt_speed": 2.0, "token_speed": 2.0}},
        "pools": [{"role": "prompt", "hardware": "l40s"}, {"role": "token", "hardware": "a100"}]})
    assert config.hardware("l40s") == HardwareProfile("l40s", 0.3, 0.5)
    assert config.hardware("h100") == HardwareProfile("h100", 2.0, 2.0)  # a config's class wins
    assert config.hardware("a100") is HARDWARE_CLASSES["a100"]
    with pytest.raises(ValueError, match="'b200' is unknown; known: a100, cpu, h100, h100-cap, l40s"):
        config.hardware("b200")


def test_worker_resources_ray_options():
    assert WorkerResources().ray_options() == {"num_cpus": 1.0, "num_gpus": 0.0}
    full = WorkerResources(num_cpus=2, num_gpus=0.5, accelerator_type="A100", resources={"splitserve-token": 1})
    options = full.ray_options()
    assert options == {"num_cpus": 2.0, "num_gpus": 0.5, "accelerator_type": "A100",
                       "resources": {"splitserve-token": 1.0}}
    ray.remote(_Actor).options(**options)  # Ray accepts them
    options["resources"]["splitserve-token"] = 9  # a copy: the config is unchanged
    assert full.resources == {"splitserve-token": 1.0}


def test_accelgen_is_chosen_per_pool_and_its_settings_reach_the_engine_and_the_simulator():
    from splitserve.sim.from_config import scenario_from_config

    config = ClusterConfig.model_validate({
        "pools": [{"role": role, "hardware": "h100"} for role in ("prompt", "token", "mixed")],
        "engine": {"mixed_policy": "accelgen", "prompt_policy": "accelgen_prompt",
                   "slo_scheduling": {"pivot_ms": 40, "default_tbt_ms": 100, "window_ms": 500}}})
    engine = config.engine
    policies = [engine.policy_for(role) for role in ("prompt", "token", "mixed")]
    assert policies == ["accelgen_prompt", "token", "accelgen"]
    slo = engine.engine_config("accelgen").slo
    assert (slo.pivot_time_s, slo.default_tbt_s, slo.window_s, slo.pivot_tokens) == (0.04, 0.1, 0.5, 512)
    scenario = scenario_from_config(config)
    assert [scenario.policy_for(p.role) for p in scenario.pools] == ["accelgen_prompt", "token", "accelgen"]
    assert scenario.limits.slo == slo
    with pytest.raises(ValidationError, match="pivot_ms"):
        ClusterConfig.model_validate({"engine": {"slo_scheduling": {"pivot_ms": 0}}})


def test_a_worker_engine_is_sized_for_every_policy_a_pool_move_may_give_it():
    disaggregated = ClusterConfig.model_validate({"pools": [{"role": "prompt"}, {"role": "token"}],
                                                  "engine": {"mixed_policy": "orca", "gpu_reserve_bytes": 2**30}})
    config = disaggregated.engine_config("token")
    assert (config.policy, config.switch_policies, config.gpu_reserve_bytes) == \
        ("token", ("prompt", "token", "orca"), 2**30)
    config = ClusterConfig.model_validate({"pools": [{"role": "mixed"}]}).engine_config("mixed")
    assert (config.policy, config.switch_policies) == ("mixed", ("mixed",))


def test_every_worker_engine_gets_the_kv_cache_dtype_and_a_wrong_one_is_named():
    config = ClusterConfig.model_validate({"pools": [{"role": "prompt"}, {"role": "token"}],
                                           "engine": {"kv_cache_dtype": "fp8"}})
    assert {config.engine_config(role).kv_cache_dtype for role in ("prompt", "token")} == {"fp8"}
    with pytest.raises(ValidationError, match="kv_cache_dtype"):
        ClusterConfig.model_validate({"engine": {"kv_cache_dtype": "int8"}})


def test_served_model_names_are_one_or_several_aliases():
    assert ClusterConfig().model_names == ("demo",) and ClusterConfig().model_name == "demo"
    assert ClusterConfig(served_model_name="llama").model_names == ("llama",)
    aliases = ClusterConfig(served_model_name=["llama-3-8b", "gpt-3.5-turbo"])
    assert aliases.model_names == ("llama-3-8b", "gpt-3.5-turbo") and aliases.model_name == "llama-3-8b"
    for bad in ([], ["a", "a"], [""], ["x" * 257], [f"m{i}" for i in range(17)]):
        with pytest.raises(ValueError, match="served_model_name"):
            ClusterConfig(served_model_name=bad)


def test_score_label_tokens_are_one_or_two_single_tokens_of_the_vocabulary():
    from splitserve.engine.demo import demo_tokenizer

    tokenizer = demo_tokenizer()
    assert ClusterConfig().score_labels(tokenizer) == ()
    assert ClusterConfig(score_label_tokens=["n", "y"]).score_labels(tokenizer) == tuple(
        tokenizer.encode("ny", add_special_tokens=False))
    for bad in ([], ["n", "n"], [""], ["a", "b", "c"]):
        with pytest.raises(ValueError, match="score_label_tokens"):
            ClusterConfig(score_label_tokens=bad)
    with pytest.raises(ValueError, match="'yes' is 3 tokens"):  # the demo's tokens are bytes
        ClusterConfig(score_label_tokens=["no", "yes"][1:]).score_labels(tokenizer)


def test_prefix_aware_placement_settings_reach_the_placement():
    config = ClusterConfig.model_validate({"scheduler": {"prefill_saved_weight": 2, "transfer_saved_weight": 0.5,
                                                         "prefix_index_blocks": 1000}})
    assert config.prefix_options() == PrefixOptions(True, 2, 0.5, 1000)
    assert ClusterConfig().prefix_options() == PrefixOptions()  # the defaults agree
    assert not ClusterConfig.model_validate({"engine": {"enable_prefix_caching": False}}).prefix_options().aware
    assert not ClusterConfig.model_validate({"scheduler": {"prefix_aware": False}}).prefix_options().aware
    # requests name their prompts' blocks in the engines' block size, or none when it does not act
    assert config.prefix_block_size() == config.engine.block_size
    assert ClusterConfig.model_validate({"scheduler": {"prefix_aware": False}}).prefix_block_size() == 0


def test_lora_aware_placement_settings_reach_the_placement_where_engines_hold_slots():
    config = ClusterConfig.model_validate({"engine": {"max_loras": 2},
                                           "scheduler": {"lora_swap_share": 0.2, "lora_wait_share": 3}})
    assert config.adapter_options() == AdapterOptions(True, 0.2, 3)
    assert ClusterConfig.model_validate({"engine": {"max_loras": 2}}).adapter_options() == AdapterOptions()
    assert not ClusterConfig().adapter_options().aware  # no slots: nothing to weigh
    assert not ClusterConfig.model_validate({"engine": {"max_loras": 2},
                                             "scheduler": {"lora_aware": False}}).adapter_options().aware
    with pytest.raises(ValueError, match="lora_wait_share"):
        ClusterConfig.model_validate({"scheduler": {"lora_wait_share": -1}})


def test_a_pool_whose_tensor_parallel_size_cannot_split_the_model_is_named():
    demo = demo_model_config()  # 8 attention heads, 4 KV heads
    for size in (1, 2, 8):
        ClusterConfig(pools=[{"role": "mixed", "tensor_parallel_size": size}]).check_model(demo)
    split = ClusterConfig(pools=[{"role": "prompt", "tensor_parallel_size": 2},
                                 {"role": "token", "tensor_parallel_size": 3}])
    with pytest.raises(ConfigError, match="pools: the token pool's tensor_parallel_size=3 does not divide "
                                          "num_attention_heads=8"):
        split.check_model(demo)
