"""The stage graph: a DAG of stages within one iteration, plus the edges across iterations.

Within an iteration an edge ``a -> b`` means ``b`` lists ``a`` in ``after`` (and usually
reads columns ``a`` writes). Across iterations, a training stage that updates model ``M``
in iteration ``k`` must finish before any stage uses ``M`` in iteration ``k + 1``; and
within iteration ``k`` it must wait for every other stage that uses ``M`` (they must see
the weights from before the update).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from rlhfflow.errors import UserError
from rlhfflow.sdk import SOURCE_COLUMNS, Column, IterationMetric

SOURCE = "data"
"""Name of the pseudo-stage that provides prompts (``SOURCE_COLUMNS``)."""


@dataclass(frozen=True)
class StageNode:
    """One stage as the graph sees it: what it is, what it uses, reads and writes.

    ``type`` is what the file says (a registered name or an import path) and ``impl`` the
    class's import path, by which workers create the stage. The capabilities (``trains``,
    ``once``, ``per_batch``, ``generates``, ``scores``, ``reports`` and a generator's ``response_tokens`` and
    ``temperature``) are copied from the ``Stage`` class and its params, so the planner
    and executor never ask for a type by name.
    """

    name: str
    type: str
    model: str | None
    after: tuple[str, ...]
    reads: tuple[str, ...]
    writes: Mapping[str, Column] = field(default_factory=dict)
    trains: bool = False
    once: bool = False
    per_batch: bool = False
    generates: bool = False
    scores: bool = False
    reports: bool = False
    #: decodes from its model (a generator, an evaluation, a greedy baseline)
    samples: bool = False
    response_tokens: int = 0
    temperature: float = 1.0
    #: a generator's model turns per response at most (``PlanHints.turns``)
    turns: int = 1
    #: its environment steps run on the CPU pool, not on its model worker
    #: (``PlanHints.env_on_pool``)
    env_on_pool: bool = False
    impl: str = ""
    #: other models the stage reads besides ``model`` (a generator's draft model): they
    #: order the stage after their trainers as ``model`` does
    uses: tuple[str, ...] = ()
    #: the column whose nonzero rows the stage works on (``PlanHints.row_filter``), and the
    #: most of a batch's rows the stage keeps when it marks rows (``PlanHints.kept_per_prompt``)
    row_filter: str | None = None
    kept_share: float = 1.0
    #: the stage works in one iteration of this many (``PlanHints.every``)
    every: int = 1
    #: its model's work per token, in forward passes (``PlanHints.passes``)
    passes: float = 1.0
    #: it keeps work in flight across iterations (``PlanHints.streams``)
    streams: bool = False
    #: it returns the episodes that finished first, with their source columns, which the
    #: stages after it read from it (``PlanHints.reorders``)
    reorders: bool = False
    #: the figures of the iteration's record it declares (``Stage.iteration_metrics``)
    metrics: tuple[IterationMetric, ...] = ()


class CycleError(UserError, ValueError):
    """The ``after`` edges form a cycle; ``cycle`` lists it, first stage repeated last."""

    def __init__(self, cycle: list[str]) -> None:
        self.cycle = cycle
        super().__init__(" -> ".join(cycle))


class StageGraph:
    """Stages in dependency order, with the questions the executor and CLI ask of them."""

    def __init__(self, nodes: Mapping[str, StageNode]) -> None:
        self.nodes = dict(nodes)
        self.order = self._topological_order()
        self._upstream = {name: self._closure(name) for name in self.order}
        # a stage that reads a model a trainer updates runs before it in the iteration
        # (release_edges), so it comes first in the order too, wherever it is declared:
        # the compiler builds a trainer's waits from the tasks of those users
        try:
            self.order = self._topological_order(self.release_edges())
        except CycleError:  # release edges that contradict each other: keep `after` only
            pass

    # ----------------------------------------------------------------- structure
    def _topological_order(self, extra: Iterable[tuple[str, str]] = ()) -> list[str]:
        """Kahn's algorithm over the ``after`` edges plus ``extra`` ``(before, after)``
        pairs; ties broken by declaration order so output is stable."""
        declared = list(self.nodes)
        parents = {n: set(self.nodes[n].after) for n in declared}
        for before, after in extra:
            parents[after].add(before)
        indegree = {n: len(parents[n]) for n in declared}
        ready = [n for n in declared if indegree[n] == 0]
        order: list[str] = []
        while ready:
            name = ready.pop(0)
            order.append(name)
            for other in declared:
                if name in parents[other]:
                    indegree[other] -= 1
                    if indegree[other] == 0:
                        ready.append(other)
            ready.sort(key=declared.index)
        if len(order) < len(declared):
            raise CycleError([] if extra else self._find_cycle(set(declared) - set(order)))
        return order

    def _find_cycle(self, remaining: set[str]) -> list[str]:
        start = min(remaining, key=list(self.nodes).index)
        path, seen = [start], {start}
        while True:
            nxt = next(a for a in self.nodes[path[-1]].after if a in remaining)
            if nxt in seen:
                cycle = path[path.index(nxt):] + [nxt]
                return list(reversed(cycle))
            path.append(nxt)
            seen.add(nxt)

    def _closure(self, name: str) -> frozenset[str]:
        seen: set[str] = set()
        stack = list(self.nodes[name].after)
        while stack:
            current = stack.pop()
            if current not in seen:
                seen.add(current)
                stack.extend(self.nodes[current].after)
        return frozenset(seen)

    def upstream(self, name: str) -> frozenset[str]:
        """Every stage ``name`` transitively waits for within an iteration."""
        return self._upstream[name]

    @property
    def setup_stages(self) -> list[str]:
        """Stages that run once, before the first iteration (SFT, reward-model training)."""
        return [n for n in self.order if self.nodes[n].once]

    @property
    def loop_stages(self) -> list[str]:
        """Stages that run every iteration, in dependency order."""
        return [n for n in self.order if not self.nodes[n].once]

    def scorers(self) -> list[str]:
        """Loop stages that score responses with reward functions (``Stage.scores``), in
        dependency order."""
        return [n for n in self.loop_stages if self.nodes[n].scores]

    def generators(self) -> list[str]:
        """Loop stages that sample responses (``Stage.generates``), in dependency order."""
        return [n for n in self.loop_stages if self.nodes[n].generates]

    @property
    def response_tokens(self) -> int:
        """The longest response any generator samples (0 without a generator)."""
        return max((self.nodes[n].response_tokens for n in self.generators()), default=0)

    def producer(self, column: str, consumer: str) -> str | None:
        """The upstream stage of ``consumer`` that writes ``column`` (``SOURCE`` for prompts,
        or the stage upstream that reorders rows: its rows are other iterations' too)."""
        if column in SOURCE_COLUMNS:
            return next((n for n in self.order if n in self._upstream[consumer]
                         and self.nodes[n].reorders), SOURCE)
        for name in self.order:
            if name in self._upstream[consumer] and column in self.nodes[name].writes:
                return name
        return None

    def writers(self, column: str) -> list[str]:
        """All stages that write ``column``."""
        return [n for n in self.order if column in self.nodes[n].writes]

    def columns(self) -> dict[str, Column]:
        """Every column of an iteration's experience: the source's and the loop stages'."""
        out = dict(SOURCE_COLUMNS)
        for name in self.loop_stages:
            out.update(self.nodes[name].writes)
        return out

    def levels(self) -> list[list[str]]:
        """Loop stages grouped by depth; stages of one level never depend on each other."""
        depth: dict[str, int] = {}
        for name in self.loop_stages:
            parents = [depth[a] for a in self.nodes[name].after if a in depth]
            depth[name] = 1 + max(parents, default=-1)
        levels: list[list[str]] = [[] for _ in range(1 + max(depth.values(), default=-1))]
        for name in self.loop_stages:
            levels[depth[name]].append(name)
        return levels

    def concurrent(self, a: str, b: str) -> bool:
        """Whether ``a`` and ``b`` may run at the same time within an iteration."""
        if self.nodes[a].once != self.nodes[b].once:
            return False  # setup stages finish before the loop starts
        return a != b and a not in self._upstream[b] and b not in self._upstream[a]

    # ----------------------------------------------------------------- models
    def users(self, model: str, stages: Iterable[str] | None = None) -> list[str]:
        """Stages that use ``model`` (read or train it, or read it beside their own)."""
        names = self.order if stages is None else stages
        return [n for n in names if self.nodes[n].model == model or model in self.nodes[n].uses]

    def trainers(self, model: str) -> list[str]:
        """Stages that update ``model``."""
        return [n for n in self.order if self.nodes[n].model == model and self.nodes[n].trains]

    def model_of(self, name: str) -> str:
        """The model of stage ``name``, for a stage that has one (a trainer, a generator);
        asking for a model-free stage's is a bug (ValueError)."""
        model = self.nodes[name].model
        if model is None:
            raise ValueError(f"stage {name!r} has no model")
        return model

    def _trained_model(self, name: str) -> str | None:
        """The model stage ``name`` trains, or None when it trains none (a stage without a
        model has no weights to update)."""
        node = self.nodes[name]
        return node.model if node.trains else None

    def loop_trained(self) -> list[str]:
        """Models that a loop stage trains (their state changes every iteration)."""
        return list(dict.fromkeys(model for n in self.loop_stages
                                  if (model := self._trained_model(n)) is not None))

    def release_edges(self) -> list[tuple[str, str]]:
        """``(user, trainer)`` pairs within an iteration: ``user`` reads the model that
        ``trainer`` updates and is not already upstream of it, so it must finish first."""
        edges: list[tuple[str, str]] = []
        for trainer in self.loop_stages:
            model = self._trained_model(trainer)
            if model is None:
                continue
            for user in self.users(model, self.loop_stages):
                if user != trainer and user not in self._upstream[trainer] \
                        and trainer not in self._upstream[user]:
                    edges.append((user, trainer))
        return edges

    def cross_iteration_edges(self) -> list[tuple[str, str]]:
        """``(trainer, user)``: ``user`` in iteration k+1 waits for ``trainer`` in k."""
        edges: list[tuple[str, str]] = []
        for trainer in self.loop_stages:
            model = self._trained_model(trainer)
            if model is not None:
                edges.extend((trainer, user) for user in self.users(model, self.loop_stages))
        return edges

    # ----------------------------------------------------------------- rendering
    def _edges(self) -> list[tuple[str, str, str]]:
        """``(src, dst, label)`` with the columns that flow along each edge as label."""
        edges: list[tuple[str, str, str]] = []
        for name in self.order:
            node = self.nodes[name]
            sources: dict[str, list[str]] = {}
            for column in node.reads:
                sources.setdefault(self.producer(column, name) or "?", []).append(column)
            for parent in node.after:
                sources.setdefault(parent, [])
            for src, cols in sources.items():
                if src == SOURCE and not cols:
                    continue
                edges.append((src, name, ", ".join(c for c in cols if c not in SOURCE_COLUMNS)
                              if src != SOURCE else "prompts"))
        return edges

    def _label(self, name: str) -> str:
        node = self.nodes[name]
        model = f" @{node.model}" if node.model else ""
        flags = " [once]" if node.once else ""
        return f"{name} ({node.type}{model}){flags}"

    def to_text(self) -> str:
        """A terminal rendering: stages by level, their inputs, outputs and model edges."""
        lines = []
        setup = self.setup_stages
        if setup:
            lines.append("setup (once, before iteration 0):")
            for name in setup:
                after = ", ".join(self.nodes[name].after) or "-"
                lines.append(f"  {self._label(name)}  after: {after}")
        lines.append("each iteration:")
        lines.append(f"  {SOURCE}  -> {', '.join(sorted(SOURCE_COLUMNS))}")
        for depth, level in enumerate(self.levels()):
            tag = f"level {depth}" + (" (run concurrently)" if len(level) > 1 else "")
            lines.append(f"  {tag}:")
            for name in level:
                node = self.nodes[name]
                ins = ", ".join(f"{c}<-{self.producer(c, name)}" for c in node.reads) or "-"
                outs = ", ".join(node.writes) or "-"
                lines.append(f"    {self._label(name)}")
                lines.append(f"      reads:  {ins}")
                lines.append(f"      writes: {outs}")
        cross = self.cross_iteration_edges()
        if cross:
            lines.append("across iterations (new weights):")
            for trainer, user in cross:
                lines.append(f"  {trainer}[k] -> {user}[k+1]  ({self.nodes[trainer].model})")
        return "\n".join(lines)

    def to_dot(self) -> str:
        """Graphviz DOT; cross-iteration edges are dashed."""
        lines = ["digraph pipeline {", "  rankdir=LR;", "  node [shape=box];",
                 f'  "{SOURCE}" [shape=cylinder];']
        for name in self.order:
            style = ", style=rounded" if self.nodes[name].once else ""
            lines.append(f'  "{name}" [label="{self._label(name)}"{style}];')
        for src, dst, label in self._edges():
            lines.append(f'  "{src}" -> "{dst}" [label="{label}"];')
        for trainer, user in self.cross_iteration_edges():
            lines.append(f'  "{trainer}" -> "{user}" [style=dashed, label="next iteration"];')
        lines.append("}")
        return "\n".join(lines)

    def to_mermaid(self) -> str:
        """Mermaid flowchart; cross-iteration edges are dotted. Node ids get a prefix
        because Mermaid reserves some words (a stage may be called ``end``)."""
        def node(name: str) -> str:
            return f"s_{name}"

        lines = ["flowchart LR", f"  {node(SOURCE)}[({SOURCE})]"]
        for name in self.order:
            lines.append(f'  {node(name)}["{self._label(name)}"]')
        for src, dst, label in self._edges():
            arrow = f"-->|{label}|" if label else "-->"
            lines.append(f"  {node(src)} {arrow} {node(dst)}")
        for trainer, user in self.cross_iteration_edges():
            lines.append(f"  {node(trainer)} -.->|next iteration| {node(user)}")
        return "\n".join(lines)
