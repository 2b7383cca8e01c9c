"""Small bar charts as inline SVG, drawn on the server for the admin: no JavaScript, no
asset from elsewhere, and every text escaped by ``format_html``.

A chart has one slot per minute. A minute with values is a bar (its layers stacked,
the first at the bottom) standing on a short tick, so that a zero still shows; a minute
without values is left empty: a gap is not a zero. The y axis is labelled with 0 and
its top (a round number at or above the highest bar), the x axis with the first, the
middle and the last minute. Each bar has a ``<title>`` (a tooltip) with its minute and
values, and the chart an ``aria-label`` and ``<title>`` that sum it up.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Mapping, Sequence

from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString
from django.utils.translation import gettext as _

SLOT = 8  # px per minute
BAR = 6  # px: a bar's width; the rest of the slot is the space between bars
PLOT_HEIGHT = 90
LEFT = 44  # room for the y axis labels
RIGHT = 12
TOP = 24  # room for the title and the legend
BOTTOM = 18  # room for the time labels
TICK = 1.5  # px: the mark under every minute that has values
MINUTE = dt.timedelta(minutes=1)


@dataclasses.dataclass(frozen=True)
class Layer:
    """One stacked part of the bars: its legend label and colour."""

    label: str
    colour: str


@dataclasses.dataclass(frozen=True)
class BarChart:
    title: str
    layers: Sequence[Layer]
    start: dt.datetime  # the first slot's minute
    minutes: int  # how many slots
    values: Mapping[dt.datetime, Sequence[int]]  # minute -> one value per layer; absent: gap

    def slots(self) -> list[tuple[int, dt.datetime, Sequence[int]]]:
        """(slot index, minute, values) of each minute in the chart that has values."""
        minutes = (self.start + i * MINUTE for i in range(self.minutes))
        return [(i, at, self.values[at]) for i, at in enumerate(minutes) if at in self.values]


def axis_top(value: int) -> int:
    """The smallest of 1, 2, 5, 10, 20, 50, ... at or above ``value``."""
    top = 1
    while True:
        for step in (1, 2, 5):
            if top * step >= value:
                return top * step
        top *= 10


def clock(at: dt.datetime) -> str:
    """``at`` as hours and minutes in the current time zone."""
    return timezone.localtime(at).strftime("%H:%M")


def render(chart: BarChart) -> SafeString:
    """``chart`` as an ``<svg>`` element, ready to be put in a page."""
    slots = chart.slots()
    peak = max((sum(values) for _, _, values in slots), default=0)
    top = axis_top(peak)
    width = LEFT + chart.minutes * SLOT + RIGHT
    height = TOP + PLOT_HEIGHT + BOTTOM
    summary = _("%(title)s, the last %(minutes)d minutes: %(sampled)d sampled, highest %(top)d") % {
        "title": chart.title,
        "minutes": chart.minutes,
        "sampled": len(slots),
        "top": peak,
    }
    return format_html(
        '<svg xmlns="http://www.w3.org/2000/svg" class="outbox-chart" role="img" '
        'aria-label="{}" width="{}" height="{}" viewBox="0 0 {} {}" font-size="11" '
        'fill="currentColor"><title>{}</title>{}{}{}{}</svg>',
        summary,
        width,
        height,
        width,
        height,
        summary,
        _heading(chart, width),
        _axes(chart, top, width),
        format_html_join("", "{}", ((_bar(chart, slot, top),) for slot in slots)),
        _times(chart),
    )


def _heading(chart: BarChart, width: int) -> SafeString:
    """The title on the left, the legend on the right (its labels right-aligned)."""
    legend, right = [], width - RIGHT
    for layer in reversed(chart.layers):
        legend.append(
            format_html(
                '<text class="outbox-chart-legend" x="{}" y="12" text-anchor="end">{}</text>'
                '<rect x="{}" y="4" width="9" height="9" fill="{}"></rect>',
                right,
                layer.label,
                right - _text_width(layer.label) - 13,
                layer.colour,
            )
        )
        right -= _text_width(layer.label) + 24
    return format_html(
        '<text class="outbox-chart-title" x="{}" y="12" font-weight="bold">{}</text>{}',
        LEFT,
        chart.title,
        format_html_join("", "{}", ((item,) for item in legend)),
    )


def _text_width(text: str) -> int:
    """About how wide ``text`` is at 11 px (the legend is laid out without a browser)."""
    return round(len(text) * 6.2)


def _axes(chart: BarChart, top: int, width: int) -> SafeString:
    baseline = TOP + PLOT_HEIGHT
    return format_html(
        '<g class="outbox-chart-axis"><text class="outbox-chart-ymax" x="{}" y="{}" '
        'text-anchor="end">{}</text><text x="{}" y="{}" text-anchor="end">0</text>'
        '<line x1="{}" y1="{}" x2="{}" y2="{}" stroke="currentColor" stroke-opacity="0.25" '
        'stroke-dasharray="2 3"></line><line x1="{}" y1="{}" x2="{}" y2="{}" '
        'stroke="currentColor" stroke-opacity="0.6"></line></g>',
        LEFT - 6,
        TOP + 4,
        f"{top:,}",
        LEFT - 6,
        baseline + 4,
        LEFT,
        TOP,
        width - RIGHT,
        TOP,
        LEFT,
        baseline,
        width - RIGHT,
        baseline,
    )


def _bar(chart: BarChart, slot: tuple[int, dt.datetime, Sequence[int]], top: int) -> SafeString:
    index, at, values = slot
    x = LEFT + index * SLOT + (SLOT - BAR) / 2
    y = float(TOP + PLOT_HEIGHT)
    rects = []
    for layer, value in zip(chart.layers, values, strict=True):
        height = PLOT_HEIGHT * value / top
        y -= height
        rects.append((x, round(y, 2), BAR, round(height, 2), layer.colour))
    tooltip = ", ".join(
        f"{layer.label} {value:,}" for layer, value in zip(chart.layers, values, strict=True)
    )
    return format_html(
        '<g class="outbox-chart-bar"><title>{}: {}</title>'
        '<rect x="{}" y="{}" width="{}" height="{}" fill-opacity="0.5"></rect>{}</g>',
        clock(at),
        tooltip,
        x,
        TOP + PLOT_HEIGHT,
        BAR,
        TICK,
        format_html_join("", '<rect x="{}" y="{}" width="{}" height="{}" fill="{}"></rect>', rects),
    )


def _times(chart: BarChart) -> SafeString:
    """The first, middle and last minute under the x axis."""
    y, last = TOP + PLOT_HEIGHT + BOTTOM - 3, chart.minutes - 1
    marks = ((0, "start", 0), (chart.minutes // 2, "middle", SLOT / 2), (chart.minutes, "end", 0))
    return format_html_join(
        "",
        '<text class="outbox-chart-time" x="{}" y="{}" text-anchor="{}">{}</text>',
        (
            (LEFT + index * SLOT + shift, y, anchor, clock(chart.start + min(index, last) * MINUTE))
            for index, anchor, shift in marks
        ),
    )
