"""`splitserve serve`'s flags reach the cluster config it serves (the launcher itself is stood in for);
`splitserve generate`'s reach its engine."""
import pytest

import splitserve.cluster.launcher as launcher
from splitserve.cli import main


def served_config(monkeypatch, *flags):
    seen = {}
    monkeypatch.setattr(launcher, "serve_until_interrupted",
                        lambda config, host, port, address: seen.update(config=config, port=port))
    assert main(["serve", *flags]) == 0
    return seen["config"]


def test_served_model_names_and_model_override_the_config(monkeypatch):
    config = served_config(monkeypatch, "--served-model-name", "llama-3-8b", "gpt-3.5-turbo")
    assert config.model == "demo" and config.model_names == ("llama-3-8b", "gpt-3.5-turbo")
    assert served_config(monkeypatch).model_names == ("demo",)


def test_the_scheduling_policy_reaches_the_engines_and_the_ingress(monkeypatch):
    config = served_config(monkeypatch, "--scheduling-policy", "priority")
    assert config.engine_config("prompt").scheduler_limits(64).by_priority and config.request_limits().priorities
    assert not served_config(monkeypatch).request_limits().priorities


def test_adapter_slots_and_host_memory_reach_the_engines_and_a_bad_pair_is_refused(monkeypatch, capsys):
    engine = served_config(monkeypatch, "--max-loras", "2", "--max-cpu-loras", "8").engine_config("token")
    assert (engine.max_loras, engine.max_cpu_loras, engine.host_loras) == (2, 8, 8)
    monkeypatch.setattr(launcher, "serve_until_interrupted", lambda *args: pytest.fail("started"))
    assert main(["serve", "--max-loras", "4", "--max-cpu-loras", "2"]) == 2
    assert "max_cpu_loras must be from max_loras (4" in capsys.readouterr().err


def test_lora_modules_are_served_as_models_and_a_bad_one_refused_before_anything_starts(tmp_path, monkeypatch,
                                                                                       capsys):
    from splitserve.engine.demo import demo_model_config
    from splitserve.engine.dummy_adapter import write_adapter

    path = write_adapter(tmp_path / "sql", demo_model_config(), ["q_proj"], 2, 0)
    config = served_config(monkeypatch, "--lora-modules", f"sql={path}")
    assert config.served_models.all == ("demo", "sql") and config.engine_config("token").lora_modules == (("sql", path),)
    monkeypatch.setattr(launcher, "serve_until_interrupted", lambda *args: pytest.fail("started"))
    assert main(["serve", "--lora-modules", f"chat={tmp_path / 'none'}"]) == 2
    assert "lora_modules: adapter 'chat'" in capsys.readouterr().err
    assert main(["serve", "--lora-modules", f"demo={path}"]) == 2
    assert "adapter names must differ from the model's" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--lora-modules", "sql"])
    assert "expected NAME=PATH" in capsys.readouterr().err


def test_vllms_speculative_config_reaches_the_engines_and_a_bad_one_is_refused(monkeypatch, capsys):
    spec = '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}'
    engine = served_config(monkeypatch, "--speculative-config", spec).engine_config("token")
    assert (engine.num_speculative_tokens, engine.prompt_lookup_min, engine.prompt_lookup_max) == (5, 2, 3)
    assert not served_config(monkeypatch).engine_config("token").speculative.enabled
    monkeypatch.setattr(launcher, "serve_until_interrupted", lambda *args: pytest.fail("started"))
    assert main(["serve", "--speculative-config", '{"num_speculative_tokens": 99}']) == 2
    assert "num_speculative_tokens" in capsys.readouterr().err
    for bad, message in (('{"method": "eagle", "num_speculative_tokens": 2}', "only ngram"),
                         ('{"num_speculative_tokens": 2, "draft_model": "x"}', "unknown keys ['draft_model']"),
                         ("[2]", "num_speculative_tokens"), ("{", "expected a JSON object")):
        with pytest.raises(SystemExit):
            main(["serve", "--speculative-config", bad])
        assert message in capsys.readouterr().err


def test_a_bad_name_is_refused_before_anything_starts(monkeypatch, capsys):
    monkeypatch.setattr(launcher, "serve_until_interrupted", lambda *args: pytest.fail("started"))
    assert main(["serve", "--served-model-name", "same", "same"]) == 2
    assert "served_model_name" in capsys.readouterr().err



def test_generate_builds_its_engine_with_the_kv_cache_dtype(monkeypatch, capsys):
    import splitserve
    from splitserve import LLM

    built = []
    monkeypatch.setattr(splitserve, "LLM", lambda *args, **kwargs: built.append(LLM(*args, **kwargs)) or built[-1])
    assert main(["generate", "--prompt", "paged attention", "--max-tokens", "6", "--kv-cache-dtype", "fp8"]) == 0
    assert built[0].engine.kv_cache.encoding == "fp8_e4m3" and "[6 tokens" in capsys.readouterr().out


def test_generate_drafts_with_a_speculative_config(monkeypatch, capsys):
    import splitserve
    from splitserve import LLM

    built = []
    monkeypatch.setattr(splitserve, "LLM", lambda *args, **kwargs: built.append(LLM(*args, **kwargs)) or built[-1])
    assert main(["generate", "--prompt", "abcabcabc", "--max-tokens", "6", "--speculative-config",
                 '{"num_speculative_tokens": 3}']) == 0
    assert built[0].engine.proposer.config.num_speculative_tokens == 3 and "[6 tokens" in capsys.readouterr().out


@pytest.mark.parametrize("device", ["tpu", "", "cuda:-1"])
def test_generate_refuses_a_device_it_cannot_name_with_a_usage_error(device, capsys):
    assert main(["generate", "--prompt", "x", "--device", device]) == 2
    assert "device must be auto, cpu, cuda or cuda:N" in capsys.readouterr().err


@pytest.mark.parametrize("pools, model, message", [
    ('[{role: mixed, tensor_parallel_size: 3}]', "demo", "the mixed pool's tensor_parallel_size=3 does not divide"),
    ('[{role: mixed}]', "/no/such/checkpoint", "/no/such/checkpoint"),
])
def test_serve_checks_the_model_a_local_cluster_would_load_before_it_starts(pools, model, message, tmp_path,
                                                                           monkeypatch, capsys):
    monkeypatch.setattr(launcher, "serve_until_interrupted", lambda *args: pytest.fail("started"))
    path = tmp_path / "cluster.yaml"
    path.write_text(f"model: {model}\npools: {pools}\n")
    assert main(["serve", "--config", str(path)]) == 2
    assert message in capsys.readouterr().err


def test_serve_refuses_a_config_file_of_the_wrong_shape(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(launcher, "serve_until_interrupted", lambda *args: pytest.fail("started"))
    path = tmp_path / "serve.yaml"
    path.write_text("applications: []\nhttp_options: x\n")
    assert main(["serve", "--config", str(path)]) == 2
    assert "http_options must be a mapping" in capsys.readouterr().err


def test_profile_checks_its_out_path_and_server_before_it_runs(tmp_path, capsys):
    from tests.sim.test_sim_cli import write_cpu_profile

    (tmp_path / "a-file").write_text("")
    assert main(["profile", "--out", str(tmp_path)]) == 2
    assert "is a directory: name the file to write" in capsys.readouterr().err
    assert main(["profile", "--out", str(tmp_path / "a-file" / "x.csv")]) == 2
    assert "File exists" in capsys.readouterr().err
    write_cpu_profile(tmp_path / "cpu.csv")
    for url in ("http://127.0.0.1:9", "127.0.0.1:9"):  # refused; no scheme (httpx's tracebacks)
        assert main(["profile", "--url", url, "--engine-profile", str(tmp_path / "cpu.csv"),
                     "--out", str(tmp_path / "o.json")]) == 2
        assert capsys.readouterr().err.startswith("splitserve profile: ")


def test_profile_refuses_a_batch_size_past_its_bound_with_a_usage_error(tmp_path, capsys):
    """--batch-sizes 100000 was taken, and the profile's engine exhausted memory building that batch."""
    with pytest.raises(SystemExit) as exit:
        main(["profile", "--out", str(tmp_path / "p.csv"), "--batch-sizes", "1,100000"])
    assert exit.value.code == 2
    assert "argument --batch-sizes: each must be at most 4096, got 100000" in capsys.readouterr().err
    assert not (tmp_path / "p.csv").exists()
