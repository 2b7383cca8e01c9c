"""``python -m benchmarks.plots`` on a small run's JSON: two valid PNG files."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import plots

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RUN = {
    "profile": "ci",
    "raw_confirm_batch_msgs_per_s": 5000.5,
    "relay_rabbitmq_ev_per_s": 3600.25,
    "relay_redis_ev_per_s": 6400.0,
    "relay_vs_raw": 0.72,
    "e2e_p50_ms": 2.3,
    "e2e_p90_ms": 4.1,
    "e2e_p99_ms": 9.5,
    "cpus": 2,
}


def test_the_figures_are_read_in_the_tables_order():
    assert [label for label, _, _ in plots.rates(RUN)] == [
        "RabbitMQ raw: batch, then all confirms",
        "relay -> RabbitMQ, 1 process",
        "relay -> Redis, 1 process",
    ]
    assert plots.percentiles(RUN) == {"e2e": [(50, 2.3), (90, 4.1), (99, 9.5)]}


@pytest.mark.parametrize("as_output", [False, True], ids=["json", "runner-output"])
def test_the_plots_are_png_files(tmp_path, capsys, as_output):
    pytest.importorskip("matplotlib", reason="matplotlib is missing: pip install matplotlib")
    results = tmp_path / "run.txt"
    text = json.dumps(RUN)
    results.write_text(f"profile ci: a table\n...\n{text}\n" if as_output else text)

    assert plots.main([str(results), str(tmp_path / "out")]) == 0

    written = capsys.readouterr().out.split()
    assert [p.rsplit("/", 1)[-1] for p in written] == ["throughput.png", "latency.png"]
    for name in written:
        data = (tmp_path / "out" / name.rsplit("/", 1)[-1]).read_bytes()
        assert data.startswith(PNG_MAGIC)
        assert len(data) > 1000


def test_without_matplotlib_one_line_names_the_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises
    results = tmp_path / "run.json"
    results.write_text(json.dumps(RUN))

    assert plots.main([str(results), str(tmp_path / "out")]) == 2

    assert capsys.readouterr().err == (
        "benchmarks.plots: matplotlib is missing: pip install matplotlib\n"
    )
    assert not (tmp_path / "out").exists()
