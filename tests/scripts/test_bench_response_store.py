"""The response store benchmark runs end to end: both stores timed on the same calls, the directory
holds exactly the bound's worth of files, and a reopened store reads back what the memory one holds;
a response's objects take more memory than its text."""
import json

from tests.scripts.script_runner import load_script


def test_tiny_run_writes_both_rows_and_reads_the_directory_back(tmp_path, capsys):
    out = tmp_path / "store.json"
    load_script("bench_response_store").main(["--responses", "30", "--keep", "20", "--text-chars", "100",
                                              "--dir", str(tmp_path / "files"), "--json", str(out)])
    result = json.loads(out.read_text())
    assert [row["store"] for row in result["rows"]] == ["memory", "disk"]
    for row in result["rows"]:
        assert (row["puts"], row["reads"]) == (30, 20)
        assert 0 < row["put_p50_us"] <= row["put_p99_us"] and 0 < row["read_p50_us"] <= row["read_p99_us"]
    assert result["files"] == result["reopened"] == 20 and result["reopened_equal"]
    assert result["put_ratio_disk_vs_memory"] > 0 and result["entry_bytes"] > 100
    assert "| disk |" in capsys.readouterr().out


def test_logprob_tokens_make_large_entries():
    result = load_script("bench_response_store").main(["--responses", "3", "--keep", "2", "--text-chars", "10",
                                                       "--logprob-tokens", "500", "--conversation-turns", "2"])
    assert result["entry_bytes"] > 500 * 250 and result["reopened_equal"]  # each token's five alternatives
    assert result["objects_bytes"] > 2 * result["text_bytes"] > 2 * 500 * 250  # what the store no longer holds
    assert result["replica_encode_p50_us"] > 0 and result["replica_decode_p50_us"] > 0 and result["full_collection_s"] > 0
