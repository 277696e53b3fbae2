"""Plot the learning curves of the multi-turn examples from their runs' metrics.jsonl.

    python examples/multiturn/plot.py calculator runs/multiturn-calculator docs/images/multiturn-calculator.png
    python examples/multiturn/plot.py python runs/multiturn-python docs/images/multiturn-python.png
    python examples/multiturn/plot.py guess runs/multiturn-guess docs/images/multiturn-guess.png
    python examples/multiturn/plot.py agent runs/agents-calculator docs/images/agents-calculator.png

Each panel shows the per-iteration value (dots) and its running mean over 5 iterations
(line), against the minutes since the run's first iteration started.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PANELS = {
    "calculator": [("reward_mean_tool_call", "episodes with a correct tool call"),
                   ("reward_mean_exact_answer", "exact-match accuracy")],
    "python": [("reward_mean_python_call", "episodes whose program printed the answer"),
               ("reward_mean_exact_answer", "exact-match accuracy")],
    "guess": [("turns_mean", "model turns per episode (5 at most)"),
              ("info_won_mean", "win rate")],
    "agent": [("info_tool_calls_mean", "calculator calls per episode"),
              ("info_exact_mean", "exact-match accuracy")],
}


def running_mean(values: list[float], window: int = 5) -> list[float]:
    """The mean of each value and the ``window - 1`` before it."""
    return [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
            for i in range(len(values))]


def main() -> None:
    """Read the metrics, draw one panel per figure, write the PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("example", choices=sorted(PANELS))
    parser.add_argument("run", type=Path, help="the run's output directory")
    parser.add_argument("png", type=Path)
    args = parser.parse_args()
    records = [json.loads(line) for line in
               (args.run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    minutes, elapsed = [], 0.0
    for r in records:
        elapsed += r["iteration_s"]
        minutes.append(elapsed / 60)
    fig, axes = plt.subplots(1, len(PANELS[args.example]), figsize=(9, 3.2))
    for ax, (key, title) in zip(axes, PANELS[args.example], strict=True):
        values = [r.get(key) for r in records]
        xs = [m for m, v in zip(minutes, values, strict=True) if v is not None]
        ys = [v for v in values if v is not None]
        ax.plot(xs, ys, "o", alpha=0.35, markersize=4)
        ax.plot(xs, running_mean(ys), "-", linewidth=2)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("minutes")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{records[0].get('name', args.example) if records else args.example}: "
                 f"{len(records)} iterations", fontsize=10)
    fig.tight_layout()
    args.png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.png, dpi=110)
    for key, _ in PANELS[args.example]:
        values = [r.get(key) for r in records if r.get(key) is not None]
        if values:
            head, tail = values[:5], values[-5:]
            print(f"{key}: first 5 iterations {sum(head) / len(head):.3f}, "
                  f"last 5 {sum(tail) / len(tail):.3f}")
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
