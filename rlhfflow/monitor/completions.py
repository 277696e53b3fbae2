"""Completions tables: an iteration's samples as rows (prompt, response, rewards,
advantage), read back from the committed iteration in the experience buffer, so the
coordinator carries nothing extra for them.

``OUTPUT/completions.jsonl`` gets one JSON object per sample; trackers that take tables
(W&B, TensorBoard as text) get the same rows through their sink's ``completions``. A
multi-turn episode (the ``rollout`` stage's ``turns_json``) also gets ``turns``: its
conversation, one ``{"role", "text", "span", "reward"}`` object per turn.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

# score-stage columns that are bookkeeping, not rewards
NOT_REWARDS = ("score_valid", "score_error", "score_retries")


def reward_columns(pipeline) -> list[str]:
    """The buffer columns that hold rewards: each score stage's ``scores`` and its
    per-function columns, in stage order."""
    graph = pipeline.graph
    return [column for name in graph.scorers() for column in graph.nodes[name].writes
            if column not in NOT_REWARDS]


def episode_turns(turns_json: str) -> list[dict[str, Any]]:
    """The turns of one episode from its ``turns_json`` cell ([] if it holds none)."""
    try:
        turns = json.loads(turns_json) if turns_json else []
    except ValueError:
        return []
    return [t for t in turns if isinstance(t, dict)] if isinstance(turns, list) else []


def conversation_lines(turns: list[dict[str, Any]], width: int = 0) -> list[str]:
    """An episode as text, one line per turn: ``role: text`` (newlines shown as ``⏎``),
    the model's turns with their reward when it is not 0; ``width`` > 0 cuts each line."""
    lines = []
    for turn in turns:
        text = str(turn.get("text", "")).replace("\n", " ⏎ ")
        reward = turn.get("reward")
        tail = f"   [reward {reward:g}]" if isinstance(reward, int | float) and reward \
            else ""
        line = f"{turn.get('role', '?')}: {text}"
        if width and len(line) > width - len(tail):
            line = line[:max(width - len(tail) - 3, 8)] + "..."
        lines.append(line + tail)
    return lines


def completion_rows(buffer, iteration: int, rewards: list[str]) -> list[dict[str, Any]]:
    """One dict per sample of committed ``iteration``: ``iteration``, ``prompt``,
    ``response``, each reward column present, ``advantage`` (the mean over the
    response's tokens) when the iteration has advantages, and ``turns`` (the episode's
    conversation) when it has ``turns_json``."""
    texts = buffer.text_columns(iteration)
    prompts = buffer.read_text(iteration, "prompt_text") if "prompt_text" in texts else []
    responses = buffer.read_text(iteration, "response_text") if "response_text" in texts \
        else []
    episodes = buffer.read_text(iteration, "turns_json") if "turns_json" in texts else []
    columns = buffer.columns(iteration)
    numbers = {c: buffer.read(iteration, [c])[c] for c in rewards if c in columns}
    advantages = None
    if "advantages" in columns and "response_mask" in columns:
        read = buffer.read(iteration, ["advantages", "response_mask"])
        mask = np.asarray(read["response_mask"], dtype=np.float64)
        advantages = np.asarray(read["advantages"], dtype=np.float64) * mask
        numbers["advantage"] = advantages.sum(axis=1) / np.maximum(mask.sum(axis=1), 1.0)
    rows = max([len(prompts), len(responses), *(len(v) for v in numbers.values())])
    out = []
    for i in range(rows):
        row: dict[str, Any] = {"iteration": iteration,
                               "prompt": prompts[i] if i < len(prompts) else None,
                               "response": responses[i] if i < len(responses) else None}
        for name, values in numbers.items():
            value = float(values[i])
            row[name] = value if math.isfinite(value) else None
        if i < len(episodes):
            row["turns"] = episode_turns(episodes[i])
            if advantages is not None:
                _turn_advantages(row["turns"], advantages[i])
        out.append(row)
    return out


def _turn_advantages(turns: list[dict[str, Any]], advantages: np.ndarray) -> None:
    """Give each model turn its mean advantage (per-turn credit makes them differ)."""
    for turn in turns:
        span = turn.get("span")
        if turn.get("role") == "assistant" and isinstance(span, list) and len(span) == 2 \
                and span[1] > span[0]:
            turn["advantage"] = float(advantages[span[0]:span[1]].mean())


def append_rows(path: Path, iteration: int, rows: list[dict[str, Any]]) -> None:
    """Append ``iteration``'s ``rows`` to a JSONL file, one object a line, first cutting
    the rows of ``iteration`` and later that a resumed run is redoing, so each iteration
    appears once (as in metrics.jsonl)."""
    if path.is_file():
        lines = path.read_text(encoding="utf-8").splitlines()
        if lines and json.loads(lines[-1]).get("iteration", -1) >= iteration:
            kept = [line for line in lines if json.loads(line).get("iteration", -1) < iteration]
            path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    with open(path, "a", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
