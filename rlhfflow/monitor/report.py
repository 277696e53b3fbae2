"""``rlhfflow report RUN``: one self-contained HTML file about a run, from what the run
left in its output directory: ``metrics.jsonl`` (curves, busy fractions, stage times),
``tasks.jsonl`` (a per-worker timeline of chosen iterations), ``buffer.zarr`` (sample
responses) and ``logs/`` (the end of each worker's log). Plots are PNGs drawn with
matplotlib's Agg backend, embedded as data URIs, so the file can be mailed or attached to
an issue as it is.
"""

from __future__ import annotations

import base64
import html
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlhfflow.errors import UserError
from rlhfflow.monitor.completions import episode_turns
from rlhfflow.monitor.workerlogs import LOG_DIRECTORY, log_tails, recoveries
from rlhfflow.storage import MetricsLog

TASKS_FILE = "tasks.jsonl"


class ReportError(UserError):
    """The run directory cannot be reported on: one line naming the path and why."""


def load_run(run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The metrics records and the task-interval records of ``run_dir``."""
    if not run_dir.exists():
        raise ReportError(f"{run_dir}: no such directory (expected a run's output directory)")
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir}: not a directory (expected a run's output directory)")
    metrics_file = run_dir / "metrics.jsonl"
    if not metrics_file.is_file():
        raise ReportError(f"{run_dir}: no metrics.jsonl (not a run's output directory, or "
                          f"no iteration finished yet)")
    try:
        metrics = MetricsLog(metrics_file).read()
        tasks = MetricsLog(run_dir / TASKS_FILE).read()
    except (ValueError, OSError) as exc:
        raise ReportError(str(exc).splitlines()[0]) from None
    metrics = [r for r in metrics if isinstance(r.get("iteration"), int)]
    if not metrics:
        raise ReportError(f"{metrics_file}: no iteration recorded yet")
    return metrics, tasks


def default_iterations(metrics: list[dict[str, Any]]) -> list[int]:
    """The iterations whose timeline is drawn by default: the second (the first steady
    one: the first also loads the models) and the last."""
    its = [r["iteration"] for r in metrics]
    return sorted({its[min(1, len(its) - 1)], its[-1]})


def _png(fig) -> str:
    """A matplotlib figure as a PNG data URI (and the figure closed)."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _series(metrics: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pairs = [(r["iteration"], r[key]) for r in metrics
             if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pairs], [p[1] for p in pairs]


#: iterations the headline averages: one batch's reward is noise, a few show the trend
TREND_ITERATIONS = 5


def curves_plot(metrics: list[dict[str, Any]], reward_range: tuple[float, float] | None = None,
                kl_coef: float | None = None) -> str:
    """Reward (mean, with a +/- one std band clipped to ``reward_range``, the rewards
    seen), KL and response length per iteration. An empty KL panel says why: ``kl_coef``
    is 0, or no KL was logged."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
    for ax, key, title in zip(axes, ("reward_mean", "kl_mean", "response_length_mean"),
                              ("reward", "KL (per token)", "response length (tokens)"),
                              strict=True):
        x, y = _series(metrics, key)
        ax.plot(x, y, marker="o", markersize=3, color="C0")
        if key == "reward_mean":
            xs, std = _series(metrics, "reward_std")
            if xs == x and std:
                low, high = reward_band(y, std, reward_range)
                ax.fill_between(x, low, high, alpha=0.2)
        if key == "kl_mean" and not y:
            ax.text(0.5, 0.5, kl_absent(kl_coef), ha="center", va="center", wrap=True,
                    transform=ax.transAxes, color="#666")
        ax.set_title(title)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
    return _png(fig)


#: the multi-turn rollout's per-episode means (``rollout``'s ``env_reward``, ``turns`` and
#: ``env_seconds`` columns averaged; ``info_KEY_mean`` for each of its ``params.info``)
EPISODE_METRICS = ("turns_mean", "env_reward_mean", "env_seconds_mean")


def reward_function_keys(metrics: list[dict[str, Any]]) -> list[str]:
    """The per-reward-function means the run logged (``reward_mean_NAME``)."""
    return sorted({k for r in metrics for k in r if k.startswith("reward_mean_")})


def episode_keys(metrics: list[dict[str, Any]]) -> list[str]:
    """The multi-turn metrics the run logged: turns, environment reward and time, then
    each ``info_KEY_mean`` (a tool's calls, its errors); [] for a single-turn run."""
    logged = {k for r in metrics for k in r}
    return [k for k in EPISODE_METRICS if k in logged] + sorted(
        k for k in logged if k.startswith("info_") and k.endswith("_mean"))


def panels_plot(metrics: list[dict[str, Any]], keys: Sequence[str],
                titles: Sequence[str]) -> str:
    """One panel per key of ``keys`` (titled by ``titles``), its value per iteration, up
    to four panels a row."""
    import matplotlib.pyplot as plt

    columns = min(len(keys), 4)
    rows = -(-len(keys) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(13, 3.2 * rows), squeeze=False)
    for i, ax in enumerate(axes.flat):
        if i >= len(keys):
            ax.set_visible(False)
            continue
        x, y = _series(metrics, keys[i])
        ax.plot(x, y, marker="o", markersize=3, color=f"C{i % 10}")
        ax.set_title(titles[i])
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return _png(fig)


def _component_sections(metrics: list[dict[str, Any]]) -> list[str]:
    """The report's sections for each reward function's mean and for the multi-turn
    metrics, where the run logged them."""
    parts = []
    functions = reward_function_keys(metrics)
    if functions:
        names = [k[len("reward_mean_"):] for k in functions]
        parts += ["<h2>Reward functions</h2>", "<p class='note'>Each function's mean "
                  "score (before its weight) per iteration.</p>",
                  _img(panels_plot(metrics, functions, names), "reward functions")]
    episodes = episode_keys(metrics)
    if episodes:
        titles = [EPISODE_TITLES.get(k, k.removesuffix("_mean") + " per episode")
                  for k in episodes]
        parts += ["<h2>Multi-turn episodes</h2>", "<p class='note'>Means over each "
                  "iteration's episodes; <code>info_KEY</code> sums what the environment "
                  "returned under KEY in its steps' info.</p>",
                  _img(panels_plot(metrics, episodes, titles), "multi-turn episodes")]
    lifted = _with_trainer_figures(metrics)
    streams = [k for k in STREAM_TITLES if any(k in r for r in lifted)]
    if any("episodes_in_flight" in r for r in metrics):  # a rollout with stream: true
        parts += ["<h2>Streaming episodes</h2>", "<p class='note'>The streaming rollout's "
                  "decode batch, episodes in flight, tokens' policy lag, what a step owed "
                  "and waited for, the correction's weights (docs/how-to/streaming.md).</p>",
                  _img(panels_plot(lifted, streams, [STREAM_TITLES[k] for k in streams]),
                       "streaming episodes")]
    return parts


#: the figures of a streaming rollout (and of its off-policy correction) the report plots
STREAM_TITLES = {
    "decode_occupancy": "decode batch occupancy", "episodes_in_flight": "episodes in flight",
    "started_ahead_frac": "episodes started early", "token_lag_mean": "versions behind",
    "version_spread_mean": "versions within an episode", "deferred_frac": "rows owed",
    "stream_wait_owed_s": "waiting on owed (s)", "stream_wait_groups_s": "waiting on groups (s)",
    "is_ratio_mean": "importance weight (mean)", "is_bounded_frac": "tokens bounded",
    "mismatch_kl": "sampler-learner mismatch KL"}


def _with_trainer_figures(metrics: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records with the actor trainer's correction figures lifted to the top."""
    def trained(r: dict[str, Any]) -> dict[str, Any]:
        return next((t for t in (r.get("train") or {}).values()
                     if isinstance(t, dict) and "is_ratio_mean" in t), {})
    return [{**r, **{k: v for k, v in trained(r).items() if k in STREAM_TITLES}}
            for r in metrics]


EPISODE_TITLES = {"turns_mean": "model turns per episode",
                  "env_reward_mean": "environment reward per episode",
                  "env_seconds_mean": "environment seconds per episode"}


def reward_band(mean: list[float], std: list[float], seen: tuple[float, float] | None
                ) -> tuple[list[float], list[float]]:
    """``mean -/+ std`` per iteration, clipped to ``seen`` (the lowest and highest reward
    observed): a 0/1 reward's band never reaches past 0 or 1."""
    low = [m - s for m, s in zip(mean, std, strict=True)]
    high = [m + s for m, s in zip(mean, std, strict=True)]
    if seen is not None:
        low = [min(max(v, seen[0]), seen[1]) for v in low]
        high = [min(max(v, seen[0]), seen[1]) for v in high]
    return low, high


def kl_absent(kl_coef: float | None) -> str:
    """Why the KL panel is empty."""
    if kl_coef == 0:
        return "no KL logged:\nkl_coef is 0 (no KL penalty)"
    return "no KL logged in metrics.jsonl\n(the pipeline computes none)"


def trend(metrics: list[dict[str, Any]], key: str, first: bool = False,
          n: int = TREND_ITERATIONS) -> float | None:
    """The mean of ``key`` over the last (``first``: the first) ``n`` iterations that
    logged it, or None."""
    _, values = _series(metrics, key)
    values = values[:n] if first else values[-n:]
    return sum(values) / len(values) if values else None


def reward_range(run_dir: Path) -> tuple[float, float] | None:
    """The lowest and highest valid score in the run's buffer (None without one)."""
    from rlhfflow.storage.buffer import ExperienceBuffer

    try:
        buffer = ExperienceBuffer(run_dir / "buffer.zarr", create=False)
    except FileNotFoundError:
        return None
    low, high = float("inf"), float("-inf")
    for k in buffer.iterations():
        columns = buffer.columns(k)
        if "scores" not in columns:
            continue
        read = buffer.read(k, [c for c in ("scores", "score_valid") if c in columns])
        scores = read["scores"][read["score_valid"] == 1] if "score_valid" in read \
            else read["scores"]
        if len(scores):
            low, high = min(low, float(scores.min())), max(high, float(scores.max()))
    return (low, high) if low <= high else None


def _kl_coef(run_dir: Path) -> float | None:
    try:
        return float(json.loads((run_dir / "run.json").read_text())["identity"][
            "algorithm"]["kl_coef"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def stage_time_plot(metrics: list[dict[str, Any]],
                    lost: Sequence[dict[str, Any]] = ()) -> str:
    """Compute seconds per stage per iteration (stacked), with the iteration's wall time;
    each recovery of ``lost`` (``recoveries.jsonl``) a dashed line where the run went
    back to (after its checkpoint's iteration)."""
    import matplotlib.pyplot as plt

    stages = sorted({s for r in metrics for s in r.get("stage_s") or {}})
    fig, ax = plt.subplots(figsize=(13, 3.4))
    x = [r["iteration"] for r in metrics]
    bottom = [0.0] * len(metrics)
    for i, stage in enumerate(stages):
        height = [(r.get("stage_s") or {}).get(stage, 0.0) for r in metrics]
        ax.bar(x, height, bottom=bottom, label=stage, color=f"C{i % 10}")
        bottom = [b + h for b, h in zip(bottom, height, strict=True)]
    wx, wall = _series(metrics, "iteration_s")
    ax.plot(wx, wall, color="black", marker="o", markersize=3, label="iteration wall time")
    steady = [sum((r.get("stage_s") or {}).values()) for r in metrics[1:]] + wall[1:]
    if steady and wall and wall[0] > 2 * max(steady):
        # the first iteration also loads the models: keep it from flattening the rest
        top = 1.3 * max(steady)
        ax.set_ylim(0, top)
        ax.annotate(f"{wall[0]:.1f} s (loads the models)", (wx[0], top), xytext=(8, -14),
                    textcoords="offset points", fontsize=8)
    for n, r in enumerate(lost, 1):
        x0 = r["resumed_after"] + 0.5
        ax.axvline(x0, color="red", linestyle="--", linewidth=1)
        ax.annotate(f"recovery {n}: worker lost after {r['logged']}, redone from "
                    f"{r['resumed_after'] + 1}", (x0, 1), xycoords=("data", "axes fraction"),
                    xytext=(4, -12 * n), textcoords="offset points", fontsize=8, color="red")
    ax.set_xlabel("iteration")
    ax.set_ylabel("seconds")
    ax.set_title("compute time per stage (stacked; above the wall time = overlap)")
    ax.legend(fontsize=8, ncols=4, loc="upper right")
    ax.grid(alpha=0.3, axis="y")
    return _png(fig)


def busy_plot(metrics: list[dict[str, Any]]) -> str:
    """Each worker's busy fraction per iteration."""
    import matplotlib.pyplot as plt

    workers = max((len(r.get("busy_frac") or []) for r in metrics), default=0)
    fig, ax = plt.subplots(figsize=(13, 3))
    for w in range(workers):
        pairs = [(r["iteration"], r["busy_frac"][w]) for r in metrics
                 if len(r.get("busy_frac") or []) > w]
        ax.plot([p[0] for p in pairs], [p[1] for p in pairs], marker="o", markersize=3,
                label=f"w{w}")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("iteration")
    ax.set_title("busy fraction per worker (compute time / iteration wall time)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _png(fig)


def gantt_plot(tasks: list[dict[str, Any]], iteration: int) -> str | None:
    """The task intervals the workers reported in ``iteration``'s window (tasks of the
    next iterations that overlapped it included), one row per worker, coloured by stage
    and labelled with each task's own iteration; None when none were recorded. Work that
    ran beside a task (``STAGE/PART``: a rollout's environment steps) is a thin hatched
    bar under it."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    intervals = [t for r in tasks if r.get("iteration") == iteration for t in r["tasks"]]
    if not intervals:
        return None
    origin = min(t[3] for t in intervals)
    span = max(t[4] for t in intervals) - origin
    stages = sorted({t[1] for t in intervals})
    colour = {s: f"C{i % 10}" for i, s in enumerate(stages)}
    workers = sorted({t[0] for t in intervals if t[0] is not None})
    fig, ax = plt.subplots(figsize=(13, 0.9 + 0.7 * max(1, len(workers))))
    for worker, stage, task_iteration, start, stop, _rows in intervals:
        if worker is None:
            continue
        if "/" in stage:
            ax.barh(worker + 0.3, stop - start, left=start - origin, height=0.2,
                    color=colour[stage], hatch="//", edgecolor="white", linewidth=0.3)
            continue
        ax.barh(worker, stop - start, left=start - origin, height=0.6, color=colour[stage],
                edgecolor="white", linewidth=0.5)
        if stop - start > span / 40:
            ax.text(start - origin + (stop - start) / 2, worker, str(task_iteration),
                    ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(workers, [f"w{w}" for w in workers])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(f"iteration {iteration}: tasks per worker (numbers: the task's iteration)")
    ax.legend(handles=[Patch(color=colour[s], label=s) for s in stages], fontsize=8,
              ncols=min(len(stages), 6), loc="upper center", bbox_to_anchor=(0.5, -0.35))
    ax.grid(alpha=0.3, axis="x")
    return _png(fig)


def sample_responses(run_dir: Path, iterations: Sequence[int], per_iteration: int
                     ) -> dict[int, list[tuple[str, str | list[dict], float | None]]]:
    """Up to ``per_iteration`` (prompt, response, score) rows of each committed iteration
    in ``iterations``, from the run's buffer ({} without one); the response of a
    multi-turn episode is its list of turns (``turns_json``)."""
    from rlhfflow.storage.buffer import ExperienceBuffer

    try:
        buffer = ExperienceBuffer(run_dir / "buffer.zarr", create=False)
    except FileNotFoundError:
        return {}
    committed = set(buffer.iterations())
    out = {}
    for k in iterations:
        if k not in committed or "response_text" not in buffer.text_columns(k):
            continue
        responses = buffer.read_text(k, "response_text")[:per_iteration]
        text = buffer.text_columns(k)
        prompts = buffer.read_text(k, "prompt_text")[:per_iteration] \
            if "prompt_text" in text else [""] * len(responses)
        fields = buffer.read_text(k, "prompt_fields")[:per_iteration] \
            if "prompt_fields" in text else ["{}"] * len(prompts)
        prompts = [shown_prompt(p, f) for p, f in zip(prompts, fields, strict=False)]
        if "turns_json" in text:
            responses = [episode_turns(t) for t in
                         buffer.read_text(k, "turns_json")[:per_iteration]]
        try:
            scores = [float(s) for s in buffer.read(k, ["scores"], stop=len(responses))[
                "scores"]]
        except (KeyError, ValueError):
            scores = [None] * len(responses)
        out[k] = list(zip(prompts, responses, scores, strict=False))
    return out


#: (start, end) of a user turn in common chat templates (ChatML, Llama 3, Gemma, Mistral)
USER_TURN_MARKERS = (("<|im_start|>user", "<|im_end|>"),
                     ("<|start_header_id|>user<|end_header_id|>", "<|eot_id|>"),
                     ("<start_of_turn>user", "<end_of_turn>"), ("[INST]", "[/INST]"))


def shown_prompt(prompt_text: str, fields_json: str = "{}") -> str:
    """What a reader wants of a prompt: for a chat prompt the user's last turn (from the
    record's ``messages`` kept in ``prompt_fields``, else cut from the rendered text at
    the last user marker of a known template), for a plain one the text as it is."""
    try:
        messages = json.loads(fields_json).get("messages")
    except (ValueError, AttributeError):
        messages = None
    if isinstance(messages, list):
        users = [m.get("content") for m in messages if isinstance(m, dict)
                 and m.get("role") == "user" and isinstance(m.get("content"), str)]
        if users:
            return users[-1]
    for start, end in USER_TURN_MARKERS:
        if start in prompt_text:
            turn = prompt_text.rpartition(start)[2].partition(end)[0]
            return turn.removeprefix(":").strip()
    return prompt_text


def _spread(values: list[int], n: int) -> list[int]:
    """At most ``n`` of ``values``, evenly spread, first and last included."""
    if len(values) <= n:
        return values
    return sorted({values[round(i * (len(values) - 1) / (n - 1))] for i in range(n)})


def _summary_table(metrics: list[dict[str, Any]]) -> str:
    n = TREND_ITERATIONS
    rows = [("iterations recorded", len(metrics))]
    for key, label in (("reward_mean", "reward mean"), ("kl_mean", "KL"),
                       ("response_length_mean", "response length")):
        rows += [(f"{label}, first {n} iterations", trend(metrics, key, first=True)),
                 (f"{label}, last {n} iterations", trend(metrics, key))]
    rows += [("mean iteration time (s)",
              sum(r.get("iteration_s", 0.0) for r in metrics) / len(metrics)),
             ("max staleness", max((r["staleness_max"] for r in metrics
                                    if r.get("staleness_max") is not None), default=None))]
    rows += _utilisation_rows(metrics)
    cells = "".join(f"<tr><th>{html.escape(k)}</th><td>{_fmt(v)}</td></tr>" for k, v in rows)
    return f"<table class='summary'>{cells}</table>"


def _utilisation_rows(metrics: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """MFU, model FLOP rate and matmul peaks over the steady iterations (all but the
    first, which loads the models, and the last), as the run's closing line gives them."""
    from rlhfflow.plan.flops import run_utilisation

    steady = metrics[1:-1] if len(metrics) > 2 else metrics
    summary = run_utilisation(steady)
    if not summary:
        return []
    peaks = ", ".join(f"{dtype} {v / 1e9:.4g}"
                      for dtype, v in summary["matmul_peak_flops_per_s"].items())
    return [(f"MFU (model FLOPs / matmul peak), {len(steady)} steady iterations",
             summary["mfu"]),
            ("model FLOPs per second (GFLOP/s)", summary["model_flops_per_s"] / 1e9),
            ("matmul peak (GFLOP/s)", peaks or None)]


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else html.escape(str(value))


def build_report(run_dir: str | Path, iterations: Sequence[int] | None = None,
                 samples: int = 3) -> str:
    """The report of the run in ``run_dir`` as one HTML document. ``iterations``: whose
    timeline to draw (default: the second and the last); ``samples``: responses shown per
    iteration (of at most 10 iterations, spread over the run)."""
    import matplotlib

    matplotlib.use("Agg")
    run_dir = Path(run_dir)
    metrics, tasks = load_run(run_dir)
    recorded = [r["iteration"] for r in metrics]
    chosen = list(iterations) if iterations else default_iterations(metrics)
    unknown = [k for k in chosen if k not in recorded]
    if unknown:
        raise ReportError(f"{run_dir}: iteration {unknown[0]} is not in metrics.jsonl "
                          f"(recorded: {recorded[0]}..{recorded[-1]})")
    name = _run_name(run_dir)
    kl_coef = _kl_coef(run_dir)
    lost = recoveries(run_dir)
    parts = [f"<h1>rlhfflow report: {html.escape(name)}</h1>",
             f"<p class='path'>{html.escape(str(run_dir.resolve()))}</p>",
             _summary_table(metrics),
             "<h2>Reward, KL, response length</h2>",
             _img(curves_plot(metrics, reward_range(run_dir), kl_coef), "curves"),
             *([] if _series(metrics, "kl_mean")[1] else
               [f"<p class='note'>KL: {html.escape(kl_absent(kl_coef).replace(chr(10), ' '))}"
                f".</p>"]),
             *_component_sections(metrics),
             "<h2>Time per stage</h2>", _img(stage_time_plot(metrics, lost), "stage time"),
             "<h2>Worker busy fractions</h2>", _img(busy_plot(metrics), "busy fractions"),
             "<h2>Timeline</h2>", *_recoveries(lost)]
    for k in chosen:
        png = gantt_plot(tasks, k)
        parts.append(_img(png, f"timeline of iteration {k}") if png else
                     f"<p>No task intervals recorded for iteration {k} (tasks.jsonl).</p>")
    parts.append("<h2>Sample responses</h2>")
    shown = sample_responses(run_dir, _spread(recorded, 10), samples) if samples else {}
    if not shown:
        parts.append("<p>No responses in the run's buffer.</p>")
    for k, rows in shown.items():
        body = "".join(f"<tr><td><pre>{html.escape(p)}</pre></td>"
                       f"<td>{_response_cell(r)}</td><td>{_fmt(s)}</td></tr>"
                       for p, r, s in rows)
        parts.append(f"<h3>iteration {k}</h3><table class='samples'><tr><th>prompt</th>"
                     f"<th>response</th><th>score</th></tr>{body}</table>")
    parts.append(_worker_logs(run_dir))
    return _PAGE.format(title=html.escape(f"rlhfflow report: {name}"), body="\n".join(parts))


def _recoveries(lost: Sequence[dict[str, Any]]) -> list[str]:
    """The recoveries from lost workers as a list (dashed lines on the stage-time plot):
    when, what was lost and why, and where the run went back to."""
    if not lost:
        return []
    import datetime

    items = []
    for n, r in enumerate(lost, 1):
        when = datetime.datetime.fromtimestamp(r["time"], datetime.UTC)
        back = f"after iteration {r['resumed_after']}" if r["resumed_after"] >= 0 \
            else "from the start"
        items.append(f"<li>recovery {n}, {when:%Y-%m-%d %H:%M:%S} UTC, with iterations up "
                     f"to {r['logged']} logged: {html.escape(r['cause'])}; resumed {back} "
                     f"(its checkpoint), redoing what followed</li>")
    return [f"<p class='note'>The run recovered from {len(lost)} lost worker(s) (the "
            f"dashed lines above; the worker's log says why it ended):</p>"
            f"<ul class='recoveries'>{''.join(items)}</ul>"]


def _response_cell(response: str | list[dict[str, Any]]) -> str:
    """A response as HTML: its text, or an episode as a conversation, one line per turn
    (the role in bold, the model's rewards after its turns)."""
    if isinstance(response, str):
        return f"<pre>{html.escape(response)}</pre>"
    lines = []
    for turn in response:
        reward = turn.get("reward")
        tail = f" <span class='note'>[reward {reward:g}]</span>" \
            if isinstance(reward, int | float) and reward else ""
        lines.append(f"<div class='turn {html.escape(str(turn.get('role', '')))}'><b>"
                     f"{html.escape(str(turn.get('role', '?')))}</b>: "
                     f"<pre>{html.escape(str(turn.get('text', '')))}</pre>{tail}</div>")
    return "".join(lines) or "<pre></pre>"


def _worker_logs(run_dir: Path, lines: int = 20) -> str:
    """The end of each worker's log (what user code printed, logged or warned there)."""
    tails = log_tails(run_dir, lines)
    if not tails:
        return f"<h2>Worker logs</h2><p>No worker logs in {LOG_DIRECTORY}/.</p>"
    parts = [f"<h2>Worker logs</h2><p>The last {lines} lines of each, in "
             f"{html.escape(str(run_dir / LOG_DIRECTORY))}.</p>"]
    for name, tail in tails.items():
        shown = html.escape("\n".join(tail)) if tail else "(empty)"
        parts.append(f"<h3>{html.escape(name)}</h3><pre class='log'>{shown}</pre>")
    return "\n".join(parts)


def write_report(run_dir: str | Path, out: str | Path | None = None,
                 iterations: Sequence[int] | None = None, samples: int = 3) -> Path:
    """Write the report of ``run_dir`` to ``out`` (default ``RUN/report.html``)."""
    path = Path(out) if out else Path(run_dir) / "report.html"
    text = build_report(run_dir, iterations, samples)
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise ReportError(f"{path}: cannot write: {exc.strerror or exc}") from None
    return path


def _run_name(run_dir: Path) -> str:
    try:
        return json.loads((run_dir / "run.json").read_text())["identity"]["name"] or \
            run_dir.name
    except (OSError, ValueError, KeyError, TypeError):
        return run_dir.name


def _img(uri: str, alt: str) -> str:
    return f"<img src='{uri}' alt='{html.escape(alt)}'>"


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }}
img {{ max-width: 100%; display: block; margin: 0.5em 0 1.5em; }}
table {{ border-collapse: collapse; margin-bottom: 1em; }}
th, td {{ border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: left;
          vertical-align: top; }}
pre {{ margin: 0; white-space: pre-wrap; max-width: 50em; }}
pre.log {{ background: #f6f6f6; padding: 0.5em; max-width: none; font-size: 85%; }}
.path {{ color: #666; font-family: monospace; }}
.note {{ color: #666; }}
.turn pre {{ display: inline; }}
.turn.assistant {{ background: #eef5ff; }}
</style></head>
<body>
{body}
</body></html>
"""
