import pytest
from PIL import Image

from splitserve.bench.plots import cdf_plot, latency_vs_load
from splitserve.bench.report import RequestRecord, percentiles

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def records(ttft_scale):
    return [RequestRecord(i, 100, 4, 4, i * 0.1, ttft_scale * (i + 1), tuple(ttft_scale * (i + 1) + 0.05 * k
                                                                           for k in range(4)), 1.0) for i in range(20)]


def stats(scale):
    return percentiles([scale, 2 * scale, 3 * scale])


def assert_png(path, width, height):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 10_000
    with Image.open(path) as image:
        assert image.size == (width, height)


def test_cdf_plot_writes_a_two_panel_png(tmp_path):
    path = cdf_plot(records(0.01), tmp_path / "cdf.png", "TTFT and TBT")
    assert path == tmp_path / "cdf.png"
    assert_png(path, 1000, 400)


def test_cdf_plot_without_completed_requests_still_writes(tmp_path):
    failed = [RequestRecord(0, 100, 0, 4, 0.0, None, (), None, error="refused")]
    assert_png(cdf_plot(failed, tmp_path / "empty.png", "nothing completed"), 1000, 400)


def test_latency_vs_load_writes_one_panel_per_metric(tmp_path):
    rows = [{"design": design, "rate": rate, "ttft_s": stats(rate * k), "tbt_s": stats(0.01 * rate * k),
             "e2e_s": stats(rate * k + 1)} for design, k in (("splitwise", 1.0), ("mixed", 1.5)) for rate in (3, 1, 2)]
    rows.append({"design": "mixed", "rate": 4, "ttft_s": percentiles([]), "tbt_s": percentiles([]),
                 "e2e_s": percentiles([])})  # a run where nothing completed
    assert_png(latency_vs_load(rows, tmp_path / "load.png", "latency vs load"), 1500, 400)


@pytest.mark.parametrize("rows, message", [
    ([], "^rows: nothing to plot"), ([{"design": "a", "rate": 1.0, "ttft_s": {}}], "^rows: row 0 lacks tbt_s, e2e_s")])
def test_latency_vs_load_rejects_bad_rows(tmp_path, rows, message):
    with pytest.raises(ValueError, match=message):
        latency_vs_load(rows, tmp_path / "bad.png", "bad")
    assert not (tmp_path / "bad.png").exists()
