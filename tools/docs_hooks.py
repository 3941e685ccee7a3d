"""MkDocs hooks: the reference pages made from the code, and the repository's
own reports, at every build (``make docs``; mkdocs.yml's ``hooks``).

Made here, never written by hand, so they cannot drift from the code:

* ``reference/cli.md``: each ``cpjax`` command's ``--help``, as the parser prints it;
* ``reference/run-config.md``: every :class:`~cpjax.training.run_config.RunConfig`
  key, with its type, default, short flag and docstring;
* ``reference/recipes.md``: each shipped recipe, what it runs and what its
  chips' compiler said (the first comments of its file);
* ``figures/*.png``: the pictures tools/docs_figures.py draws from the code
  (the layouts of a packed row, a ring step's tiles, the strategies' bytes,
  the recipes' memory, slices as hosts x chips), on 8 CPU devices and
  libtpu's compile-only devices (the ``tpu`` extra);
* ``benchmarks.md``, ``changelog.md`` and the benchmark figures: the files
  under ``benchmarks/`` and ``CHANGELOG.md`` as they are in the repository.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import typing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def on_files(files, config):
  """Add the generated pages, the pictures and the repository's reports to the site."""
  from mkdocs.structure.files import File  # (the page makers below need no MkDocs)

  for uri, data in pictures().items():
    files.append(File.generated(config, uri, content=data))
  pages = {
    "reference/cli.md": cli_page(),
    "reference/run-config.md": run_config_page(),
    "reference/recipes.md": recipes_page(),
    "benchmarks.md": _relink(_read("benchmarks/README.md"), "benchmarks/"),
    "changelog.md": _read("CHANGELOG.md"),
  }
  for uri, text in pages.items():
    files.append(File.generated(config, uri, content=text))
  figures = os.path.join(ROOT, "benchmarks", "results")
  for name in sorted(os.listdir(figures)):
    if name.endswith((".png", ".svg")):
      files.append(
        File.generated(
          config, f"benchmarks/results/{name}", abs_src_path=os.path.join(figures, name)
        )
      )
  return files


def pictures() -> dict[str, bytes]:
  """tools/docs_figures.py's pictures, drawn on 8 CPU devices."""
  import importlib.util

  import jax

  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", 8)
  spec = importlib.util.spec_from_file_location(
    "docs_figures", os.path.join(ROOT, "tools", "docs_figures.py")
  )
  assert spec is not None and spec.loader is not None
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return {uri: draw() for uri, draw in module.FIGURES.items()}


def _read(path: str) -> str:
  with open(os.path.join(ROOT, path)) as f:
    return f.read()


def _relink(text: str, folder: str) -> str:
  """Links of a file under ``folder`` as the site's copy at its root sees them."""
  return re.sub(r"\]\((?!https?:|#)([^)]+)\)", lambda m: f"]({folder}{m.group(1)})", text)


def cli_page() -> str:
  """Every command's ``--help``, as ``cpjax COMMAND --help`` prints it."""
  from cpjax import cli

  out = ["# The `cpjax` command\n", "Generated from the parser at each build of these pages.\n"]
  for command in ([], ["train"], ["plan"], ["prepare-data"], ["demo"]):
    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.suppress(SystemExit):
      os.environ["COLUMNS"] = "100"
      cli.main([*command, "--help"])
    name = " ".join(["cpjax", *command])
    out += [f"## `{name}`\n", "```text", text.getvalue().rstrip(), "```\n"]
  return "\n".join(out)


def run_config_page() -> str:
  """Every run-config key with its type, default, short flag and docstring."""
  import dataclasses

  import docstring_parser

  from cpjax.training import run_config
  from cpjax.training.run_file import FLAGS

  flags = {key: flag for key, (flag, _) in FLAGS.items()}
  out = [
    "# Run config keys\n",
    "Every setting of `cpjax train`: a key of a run file (YAML, `--config FILE`), "
    "a dotted flag (`--optimizer.lr 1e-4`) and, for the most used, a short flag. "
    "Generated from `cpjax.training.run_config.RunConfig` at each build.\n",
  ]

  def section(cls, prefix: str) -> None:
    hints = typing.get_type_hints(cls)
    docs = {p.arg_name: p.description for p in docstring_parser.parse_from_object(cls).params}
    rows = []
    for f in dataclasses.fields(cls):
      if dataclasses.is_dataclass(hints[f.name]):
        continue
      key = prefix + f.name
      short = f"`{flags[key]}`" if key in flags else ""
      doc = " ".join((docs.get(f.name) or "").split()).replace("|", "\\|")
      kind = _type_name(hints[f.name]).replace("|", "\\|")
      rows.append(f"| `{key}` | {short} | `{kind}` | `{f.default!r}` | {doc} |")
    if rows:
      title = prefix.rstrip(".") or "top level"
      summary = " ".join((cls.__doc__ or "").split())
      out.extend([f"## `{title}`\n", summary + "\n", "| key | flag | type | default | what |"])
      out.append("|---|---|---|---|---|")
      out.extend(rows)
      out.append("")
    for f in dataclasses.fields(cls):
      if dataclasses.is_dataclass(hints[f.name]):
        section(hints[f.name], f"{prefix}{f.name}.")

  section(run_config.RunConfig, "")
  return "\n".join(out)


def _type_name(kind) -> str:
  text = repr(kind) if not isinstance(kind, type) else kind.__name__
  return re.sub(r"typing\.|<class '([^']+)'>", lambda m: m.group(1) or "", text)


def recipes_page() -> str:
  """The shipped recipes: what each runs, on which chips, and its notes."""
  from cpjax import recipes

  out = [
    "# Recipes\n",
    "`cpjax train --recipe NAME` runs one; `cpjax plan --recipe NAME --target CHIPS` "
    "compiles it for its chips. Each was written by `cpjax plan --write-config` and "
    "checked by its chips' own compiler; the notes below are its file's first comments. "
    "Generated from `cpjax/recipes/` at each build.\n",
    "![Each recipe's memory a chip by the closed form and by its compiler]"
    "(../figures/recipes-memory.png)\n",
    "*Each published-size recipe's memory a chip, by the plan's closed form and by "
    "its chips' own compiler, as a share of the chip's memory (the notes below).*\n",
    "| recipe | chips | what |",
    "|---|---|---|",
  ]
  notes = []
  for name in sorted(recipes.RECIPES):
    meta = recipes.RECIPES[name]
    with open(recipes.path(name)) as f:
      comments = [line[2:].rstrip() for line in f if line.startswith("# ")][1:]
    what = comments[0].split(": ", 1)[-1] if comments else ""
    chips = (
      f"{meta.target} ({meta.devices} x {meta.device_memory})" if meta.target else "this machine"
    )
    out.append(f"| [`{name}`](#{name}) | {chips} | {what} |")
    notes += [f"## {name}\n", *[f"* {c}" for c in comments[1:]], ""]
  return "\n".join(out + [""] + notes)
