"""``rlhfflow graph FILE``: the stage graph as text, Graphviz or Mermaid."""

from __future__ import annotations

import click

from rlhfflow.cli.common import load


@click.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--format", "fmt", type=click.Choice(["text", "dot", "mermaid"]),
              default="text", show_default=True,
              help="text for the terminal, dot for Graphviz, mermaid for Markdown.")
def graph(file: str, fmt: str) -> None:
    """Print the stage graph of a pipeline FILE.

    Edges carry the columns that flow along them; dashed (dot) or dotted
    (mermaid) edges are the new weights a training stage hands to the next
    iteration.

    \b
    Example:
      rlhfflow graph configs/ppo-tiny.yaml
      rlhfflow graph configs/ppo-tiny.yaml --format dot | dot -Tsvg > ppo.svg
    """
    stage_graph = load(file).graph
    render = {"text": stage_graph.to_text, "dot": stage_graph.to_dot,
              "mermaid": stage_graph.to_mermaid}[fmt]
    click.echo(render())
