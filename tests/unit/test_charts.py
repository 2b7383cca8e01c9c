"""The admin's SVG bar charts, drawn without a database: parsed back as XML."""

from __future__ import annotations

import datetime as dt
import xml.etree.ElementTree as ET

import pytest

from django_outbox.ops.charts import PLOT_HEIGHT, BarChart, Layer, axis_top, render

SVG = "{http://www.w3.org/2000/svg}"
START = dt.datetime(2026, 11, 21, 9, 0, tzinfo=dt.UTC)
MINUTE = dt.timedelta(minutes=1)
LAYERS = (Layer("pending", "#5b6770"), Layer("failed", "#c25e00"))


def chart(values: dict[int, tuple[int, ...]], **fields: object) -> ET.Element:
    """``values``: minute offset from START -> the layers' values; parsed SVG back."""
    spec: dict[str, object] = {
        "title": "Backlog",
        "layers": LAYERS,
        "start": START,
        "minutes": 60,
        "values": {START + offset * MINUTE: v for offset, v in values.items()},
        **fields,
    }
    return ET.fromstring(render(BarChart(**spec)))  # type: ignore[arg-type]


def bars(svg: ET.Element) -> list[ET.Element]:
    return svg.findall(f"{SVG}g[@class='outbox-chart-bar']")


def texts(svg: ET.Element, css_class: str) -> list[str]:
    return [t.text or "" for t in svg.iter(f"{SVG}text") if t.get("class") == css_class]


@pytest.mark.parametrize(
    ("value", "top"),
    [(0, 1), (1, 1), (2, 2), (3, 5), (7, 10), (10, 10), (11, 20), (120, 200), (501, 1000)],
)
def test_the_axis_top_is_the_next_round_number(value, top):
    assert axis_top(value) == top


def test_each_sampled_minute_is_a_bar_and_a_missing_minute_is_a_gap():
    svg = chart({0: (3, 1), 1: (0, 0), 59: (12, 5)})  # minutes 2..58 missing

    found = bars(svg)
    assert [bar.findtext(f"{SVG}title") for bar in found] == [
        "09:00: pending 3, failed 1",
        "09:01: pending 0, failed 0",
        "09:59: pending 12, failed 5",
    ]
    # Slots are 8 px apart: the bars stand at minutes 0, 1 and 59.
    ticks = [float(bar.findall(f"{SVG}rect")[0].get("x", "")) for bar in found]
    assert [x - ticks[0] for x in ticks] == [0, 8, 59 * 8]
    # A zero still has its tick; its layers have no height.
    zero = found[1].findall(f"{SVG}rect")
    assert float(zero[0].get("height", "")) > 0
    assert [float(r.get("height", "")) for r in zero[1:]] == [0, 0]


def test_layers_stack_in_order_and_the_axis_is_labelled():
    svg = chart({10: (30, 20)})

    pending, failed = bars(svg)[0].findall(f"{SVG}rect")[1:]
    assert float(pending.get("height", "")) == PLOT_HEIGHT * 30 / 50
    assert float(failed.get("height", "")) == PLOT_HEIGHT * 20 / 50
    assert float(failed.get("y", "")) + float(failed.get("height", "")) == pytest.approx(
        float(pending.get("y", ""))
    )
    assert (pending.get("fill"), failed.get("fill")) == ("#5b6770", "#c25e00")
    assert texts(svg, "outbox-chart-ymax") == ["50"]
    assert texts(svg, "outbox-chart-time") == ["09:00", "09:30", "09:59"]
    assert texts(svg, "outbox-chart-legend") == ["failed", "pending"]
    assert texts(svg, "outbox-chart-title") == ["Backlog"]


def test_the_chart_is_labelled_for_screen_readers():
    svg = chart({0: (1, 0), 5: (4, 3)})

    summary = "Backlog, the last 60 minutes: 2 sampled, highest 7"
    assert svg.get("role") == "img"
    assert svg.get("aria-label") == summary
    assert svg.findtext(f"{SVG}title") == summary


def test_large_numbers_get_thousands_separators():
    svg = chart({0: (12_345, 0)})

    assert texts(svg, "outbox-chart-ymax") == ["20,000"]
    assert bars(svg)[0].findtext(f"{SVG}title") == "09:00: pending 12,345, failed 0"


def test_every_text_is_escaped():
    hostile = '<script>alert("x")</script> & "quotes"'
    svg = chart(
        {0: (1, 2)},
        title=hostile,
        layers=(Layer(hostile, "#000"), Layer("failed", "#111")),
    )

    assert svg.find(f".//{SVG}script") is None
    assert texts(svg, "outbox-chart-title") == [hostile]
    assert hostile in texts(svg, "outbox-chart-legend")
    assert (svg.get("aria-label") or "").startswith(hostile)
    assert bars(svg)[0].findtext(f"{SVG}title") == f"09:00: {hostile} 1, failed 2"


def test_a_chart_without_values_has_no_bars_and_a_unit_axis():
    svg = chart({})

    assert bars(svg) == []
    assert texts(svg, "outbox-chart-ymax") == ["1"]
