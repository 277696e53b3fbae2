"""The rlhfflow page of the Dask dashboard (``/rlhfflow``, served by the scheduler).

The coordinator publishes each iteration's figures as a scheduler event (topic
``rlhfflow``, see ``rlhfflow.monitor.RunMonitor``); the preload's scheduler plugin keeps
the last 1000, and this page reads them once a second and draws reward, KL, response
length, per-stage time, worker busy fractions and staleness per iteration, and each
figure the pipeline's stages declare (``Stage.iteration_metrics``: a rollout's
``env_reward_mean``, a plugin's own) in a plot of its own.

The page is a Bokeh application added to the dashboard's own before the scheduler starts
its HTTP server, so it has to be loaded as a scheduler preload: the embedded cluster does
that itself; for a scheduler started by hand::

    dask scheduler --preload rlhfflow.monitor.dashboard

Without bokeh (the ``dashboard`` extra) importing this module adds nothing.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin

TOPIC = "rlhfflow"
"""The scheduler event topic the coordinator publishes iteration records on."""
ROUTE = "/rlhfflow"
PLUGIN_NAME = "rlhfflow-dashboard"
REFRESH_MS = 1000

# the figures drawn, one per metric: (title, [(event key, legend), ...])
_FIXED = {
    "reward": [("reward_mean", "mean")],
    "kl": [("kl_mean", "mean per token")],
    "response length (tokens)": [("response_length_mean", "mean")],
    "staleness (actor updates behind)": [("staleness_mean", "mean"),
                                         ("staleness_max", "max")],
}


def _float(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) \
        else math.nan


def latest_run(events: Any) -> list[dict[str, Any]]:
    """The iteration messages of the most recent run among the scheduler's ``events``
    ((time, message) pairs), in iteration order, the last one of a repeated iteration
    (after a recovery) winning."""
    messages = [m for _, m in events if isinstance(m, dict) and "iteration" in m]
    if not messages:
        return []
    run = messages[-1].get("run")
    by_iteration = {m["iteration"]: m for m in messages if m.get("run") == run}
    return [by_iteration[k] for k in sorted(by_iteration)]


def page_columns(messages: list[dict[str, Any]]) -> dict[str, list[float]]:
    """The page's data source: ``iteration``, one column per fixed metric, ``metric:NAME``
    per figure a stage declares, ``stage:NAME`` per stage seen and ``busy:W`` per worker
    (NaN where an iteration has no value)."""
    data: dict[str, list[float]] = {"iteration": [m["iteration"] for m in messages]}
    for series in _FIXED.values():
        for key, _ in series:
            data[key] = [_float(m.get(key)) for m in messages]
    # a declared figure gets a column (and so a plot) once an iteration gave it a value:
    # a speculative-decoding figure of a run that does not draft stays off the page
    declared = dict.fromkeys(k for m in messages for k, v in (m.get("metrics") or {}).items()
                             if math.isfinite(_float(v)))
    for name in declared:
        data[f"metric:{name}"] = [_float((m.get("metrics") or {}).get(name))
                                  for m in messages]
    stages = sorted({s for m in messages for s in m.get("stage_s") or {}})
    for stage in stages:
        data[f"stage:{stage}"] = [_float((m.get("stage_s") or {}).get(stage))
                                  for m in messages]
    workers = max((len(m.get("busy_frac") or []) for m in messages), default=0)
    for w in range(workers):
        data[f"busy:{w}"] = [_float((m.get("busy_frac") or [])[w])
                             if w < len(m.get("busy_frac") or []) else math.nan
                             for m in messages]
    return data


class MetricsPage:
    """The page's figures, redrawn from the published iterations by ``update``."""

    def __init__(self, scheduler) -> None:
        from bokeh.models import ColumnDataSource, Div

        self.scheduler = scheduler
        self.source = ColumnDataSource(page_columns([]))
        self.header = Div(text=self._header([]), sizing_mode="stretch_width")
        self.figures: dict[str, Any] = {}
        self.drawn: set[str] = set()
        for title in [*_FIXED, "stage time per iteration (s)", "busy fraction per worker"]:
            self._figure(title)
        for title, series in _FIXED.items():
            for i, (key, label) in enumerate(series):
                self._line(title, key, label, i)
        self.root = self._layout()

    def _layout(self):
        from bokeh.layouts import column

        return column(self.header, self._grid(), sizing_mode="stretch_width")

    def _grid(self):
        from bokeh.layouts import gridplot

        return gridplot(list(self.figures.values()), ncols=2, sizing_mode="stretch_width",
                        toolbar_location="right")

    def _figure(self, title: str) -> None:
        """Add a plot (a declared figure's, seen first in a published iteration)."""
        from bokeh.plotting import figure

        fig = figure(title=title, height=260, sizing_mode="stretch_width",
                     tools="pan,wheel_zoom,box_zoom,reset,hover,save",
                     x_axis_label="iteration", name=title)
        fig.toolbar.logo = None
        self.figures[title] = fig

    def _line(self, title: str, key: str, label: str, i: int) -> None:
        from bokeh.palettes import Category10_10

        color = Category10_10[i % 10]
        fig = self.figures[title]
        fig.line("iteration", key, source=self.source, legend_label=label, color=color,
                 line_width=2)
        fig.scatter("iteration", key, source=self.source, color=color, size=5)
        fig.legend.location = "top_left"
        fig.legend.click_policy = "hide"
        self.drawn.add(key)

    @staticmethod
    def _header(messages: list[dict[str, Any]]) -> str:
        if not messages:
            return ("<h3>rlhfflow</h3><p>No iteration published yet: plots appear when a "
                    "run on this cluster finishes its first iteration.</p>")
        last = messages[-1]
        name, total = last.get("pipeline", "run"), last.get("iterations", "?")
        seconds = _float(last.get("iteration_s"))
        return (f"<h3>rlhfflow: {_escape(str(name))}</h3><p>iteration "
                f"{last['iteration'] + 1} of {total}; last iteration {seconds:.2f} s</p>")

    def update(self) -> None:
        """Redraw from the published iterations when a new one arrived."""
        messages = latest_run(page_events(self.scheduler))
        data = page_columns(messages)
        if data == dict(self.source.data):
            return
        added = False
        for key in data:
            if key in self.drawn:
                continue
            if key.startswith("metric:"):  # a declared figure: a plot of its own
                self._figure(key[len("metric:"):])
                self._line(key[len("metric:"):], key, "mean", 0)
                added = True
            elif key.startswith("stage:"):
                n = sum(k.startswith("stage:") for k in self.drawn)
                self._line("stage time per iteration (s)", key, key[len("stage:"):], n)
            elif key.startswith("busy:"):
                n = sum(k.startswith("busy:") for k in self.drawn)
                self._line("busy fraction per worker", key, f"w{key[len('busy:'):]}", n)
        self.source.data = data
        if added:
            self.root.children[1] = self._grid()
        self.header.text = self._header(messages)


def _escape(text: str) -> str:
    import html

    return html.escape(text)


def rlhfflow_doc(scheduler, extra: dict[str, Any], doc) -> None:
    """The Bokeh document of the page, in the dashboard's own frame (its navigation bar)."""
    from distributed.dashboard.components.scheduler import BOKEH_THEME, env

    page = MetricsPage(scheduler)
    page.update()
    doc.add_periodic_callback(page.update, REFRESH_MS)
    doc.add_root(page.root)
    doc.title = "Dask: rlhfflow"
    doc.theme = BOKEH_THEME
    doc.template = env.get_template("simple.html")
    doc.template_variables.update(extra)


class DashboardPlugin(SchedulerPlugin):
    """Marks a scheduler that serves the page, so a run can tell whether to print its
    URL, and keeps the page's iterations: the last ``PAGE_ITERATIONS`` events of the
    topic, where the scheduler's own event log of a topic may be shorter (the embedded
    cluster's keeps 100 events, ``rlhfflow.runtime.cluster.DEVELOPER_LOGS``)."""

    name = PLUGIN_NAME

    def __init__(self) -> None:
        self.events: deque[tuple[float, Any]] = deque(maxlen=PAGE_ITERATIONS)

    def log_event(self, topic: str, msg: Any) -> None:
        if topic == TOPIC:
            self.events.append((time.time(), msg))


PAGE_ITERATIONS = 1000
"""How many iteration events (of all runs on the scheduler) the page keeps."""


def page_events(scheduler) -> list[tuple[float, Any]]:
    """The events of the page's topic: the plugin's, or the scheduler's event log on a
    scheduler without the plugin."""
    plugin = getattr(scheduler, "plugins", {}).get(PLUGIN_NAME)
    if isinstance(plugin, DashboardPlugin):
        return list(plugin.events)
    return list(scheduler.get_events(TOPIC))


def _register() -> bool:
    """Add the page to the applications the dashboard serves; False without bokeh."""
    try:
        from distributed.dashboard import scheduler as dashboard
    except ImportError:  # no bokeh: the dashboard itself is off
        return False
    dashboard.applications.setdefault(ROUTE, rlhfflow_doc)
    return True


REGISTERED = _register()


def dask_setup(scheduler) -> None:
    """Scheduler preload hook (after the page was added, at import): list the page in the
    dashboard's navigation bar and mark the scheduler as serving it."""
    if not REGISTERED or getattr(scheduler, "http_application", None) is None:
        return
    try:
        from distributed.dashboard.scheduler import template_variables

        pages = template_variables(scheduler)["pages"]  # memoised: the bar's own list
        if "rlhfflow" not in pages:
            pages.append("rlhfflow")
    except Exception:  # noqa: BLE001 - the link in the bar is a convenience
        pass
    scheduler.add_plugin(DashboardPlugin(), name=PLUGIN_NAME, idempotent=True)


def serves_page(dask_scheduler=None) -> bool:
    """On the scheduler (``client.run_on_scheduler``): whether it serves the page."""
    return PLUGIN_NAME in getattr(dask_scheduler, "plugins", {})
