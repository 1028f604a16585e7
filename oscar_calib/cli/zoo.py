"""``oscar zoo``: list the rotation zoo, regenerate its index and its markdown tables."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ._common import JsonOpt, console, emit_json, stdout, table

zoo_app = typer.Typer(name="zoo", help="The rotation zoo: committed (zoo/) and pulled ($OSCAR_CACHE/zoo) artifacts.",
                      no_args_is_help=True, rich_markup_mode="markdown")

ZooOpt = Annotated[Optional[Path], typer.Option("--zoo", help="Zoo directory (default: $OSCAR_ZOO, else the "
                                                "checkout's zoo/).")]


def _root(zoo: Path | None) -> Path:
    """The zoo directory: ``--zoo`` (which must exist) or the default."""
    from ..errors import InputError
    from ..tools.zoo import repo_zoo_dir

    if zoo is None:
        return repo_zoo_dir()
    if not zoo.is_dir():
        raise InputError(f"--zoo {zoo}: {'not a directory' if zoo.exists() else 'no such directory'}")
    return zoo


@zoo_app.command("list")
def list_command(zoo: ZooOpt = None,
                 cache: Annotated[bool, typer.Option("--cache/--no-cache", help="Include pulled artifacts.")] = True,
                 json_out: JsonOpt = False) -> None:
    """List zoo entries with their measured quality (calibration summary, verify.json, eval).

    Examples: `oscar zoo list`, `oscar zoo list --json`, `oscar zoo list --zoo my-zoo --no-cache`
    """
    from ..tools.rotationzoo import upstream_entries
    from ..tools.zoo import eval_text, list_entries, pull_cache_dir

    root = _root(zoo)
    entries = list_entries(root, include_cache=cache)
    upstream = upstream_entries()
    if json_out:
        emit_json({"zoo": str(root), "cache": str(pull_cache_dir()) if cache else None,
                   "entries": [e.to_dict() for e in entries], "upstream": upstream})
        return
    if not entries:
        console.print(f"the zoo is empty ({root}{' and ' + str(pull_cache_dir()) if cache else ''})")
    else:
        stdout.print(table("OSCAR rotation zoo", ["key", "source", "model", "layers×KV×d", "granularity",
                                                  "attn err OSCAR / Hadamard", "verified", "eval"],
                           [_entry_row(e, eval_text) for e in entries],
                           caption="attn err: the calibration's held-out attention-output error with every token "
                                   "INT2 (relative RMS, lower is better), against the data-free Hadamard rotation; "
                                   "verified: `oscar verify` passed on the content the artifact holds (stale: on other content); eval: perplexity (lower is better) and needle "
                                   "retrieval (higher is better) from `oscar eval --record`."))
    if upstream:
        ups = [[u["model_id"], "×".join(str(x) for x in u["geometry"]), u["tag"] or "–",
                f"{u['k_clip']:g} / {u['v_clip']:g}",
                "pulled" if (pull_cache_dir() / "rotationzoo" / u["name"]).is_dir() else u["pull"]] for u in upstream]
        stdout.print(table("upstream: OSCAR's RotationZoo (hf:Zhongzhu/OSCAR-RotationZoo)",
                           ["model", "layers×KV×d", "tag", "clips K / V", "get it"], ups))


def _entry_row(e, eval_text) -> list:
    q = e.quality
    err = (f"{q['mean_attn_error_oscar']:.4f} / {q['mean_attn_error_hadamard']:.4f}"
           if "mean_attn_error_oscar" in q and "mean_attn_error_hadamard" in q else "–")
    verified = {"yes": "[green]yes[/green]", "stale": "[red]stale[/red]", "no": "[red]no[/red]"}.get(e.verification,
                                                                                                    "–")
    return [e.name, e.source, f"[red]{e.error}[/red]" if e.error else e.model_id or "–", f"{e.num_layers}×{e.num_kv_heads}×{e.head_dim}",
            e.granularity or "–", err, verified, eval_text(e.eval)]


@zoo_app.command("index")
def index_command(zoo: ZooOpt = None,
                  check: Annotated[bool, typer.Option("--check", help="Only check that index.json is current; exit 1 "
                                                      "if not.")] = False,
                  json_out: JsonOpt = False) -> None:
    """Regenerate zoo/index.json from the committed artifacts (deterministic; --check for CI)."""
    from ..contract.layout import ZOO_INDEX_NAME
    from ..tools.zoo import index_is_current, write_index

    root = _root(zoo)
    if check:
        current = index_is_current(root)
        if json_out:
            emit_json({"index": str(root / ZOO_INDEX_NAME), "current": current})
        elif not current:
            typer.echo(f"{root / ZOO_INDEX_NAME} is stale or missing; run `oscar zoo index`", err=True)
        else:
            stdout.print(f"{root / ZOO_INDEX_NAME} is current")
        if not current:
            raise typer.Exit(1)
        return
    path, index = write_index(root)
    if json_out:
        emit_json({"index": str(path), "entries": len(index["entries"])})
        return
    stdout.print(f"wrote {path} ({len(index['entries'])} entries)")


@zoo_app.command("table")
def table_command(zoo: ZooOpt = None) -> None:
    """Print the zoo tables (markdown) generated from zoo/index.json: the committed
    artifacts, then the upstream seed models with their pull recipe."""
    from ..tools.zoo import load_index, markdown_table, upstream_table

    index = load_index(_root(zoo))
    ups = upstream_table(index)
    typer.echo(markdown_table(index) + (f"\nUpstream seed models (OSCAR's own rotations; `oscar pull` imports them):\n\n"
                                        f"{ups}" if ups else ""), nl=False)
