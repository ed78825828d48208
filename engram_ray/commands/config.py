"""`engram-ray config schema`: the JSON schema of a Serve application's `args` (`deployment`,
`serving`, and a group application's `group`), made from the config models
(`engram_ray.serve.settings.config.ServeAppConfig`): every setting with its type, bounds,
default and description, unknown keys refused. Point an editor's YAML support at it (completion and checks
while typing), e.g.

    engram-ray config schema > engram-ray-args.schema.json

The checks across settings (a peer group holds whole data-parallel gangs, ...) and the names
vLLM and Ray Serve take (`engine_kwargs`, ...) are not in it: `engram-ray check` runs those.

`engram-ray config tables [FILE] [--check]`: every section's settings as a markdown table
(field, default, meaning: the models' descriptions, the schema's). With FILE, the table after
each `<!-- settings: SECTION -->` line of FILE (once per section) is replaced by the generated
one (the README's tables are made this way, so they are the models' text; after a change of a
setting, `engram-ray config tables README.md`); `--check` changes nothing and exits 1 naming
each section whose table differs.
"""

from __future__ import annotations

import json

from engram_ray.errors import EngramRayError

HELP = "the Serve app's args (deployment, serving): JSON schema for editors, settings tables"
SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"  # what pydantic writes
MARKER = "<!-- settings: {} -->"  # the line before a section's table in a markdown file


def configure(parser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("schema", help="print the JSON schema of the args on stdout",
                   description="print the JSON schema of a Serve application's args "
                               "(deployment, serving) on stdout")
    tables = sub.add_parser("tables", help="every section's settings as markdown tables",
                            description="print every section's settings as markdown tables, "
                                        "or write them into FILE after its "
                                        f"{MARKER.format('SECTION')} lines")
    tables.add_argument("file", nargs="?", help="markdown file whose tables to write")
    tables.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a table of FILE differs")


def run(args) -> int:
    if args.action == "schema":
        print(json.dumps(app_args_schema(), indent=2))
        return 0
    if args.file is None:
        if args.check:
            raise EngramRayError("tables --check needs the FILE to check: engram-ray config "
                                 "tables FILE --check")
        print("\n\n".join(f"{MARKER.format(name)}\n{table}"
                           for name, table in settings_tables().items()))
        return 0
    from pathlib import Path

    path = Path(args.file)
    if not path.is_file():
        raise EngramRayError(f"tables: {args.file!r} is not a file (a markdown file with "
                             f"{MARKER.format('SECTION')} lines)")
    raw = path.read_bytes().decode()
    newline = "\r\n" if "\r\n" in raw else "\n"  # written back as the file has them
    updated, stale = with_tables(raw.replace("\r\n", "\n"), args.file)
    if args.check:
        for name in stale:
            print(f"{args.file}: the table of {name} differs from the config models "
                  f"(engram-ray config tables {args.file} writes it)")
        return 1 if stale else 0
    if stale:
        path.write_bytes(updated.replace("\n", newline).encode())
    print(f"{args.file}: {len(stale)} tables written ({', '.join(stale) or 'all current'})")
    return 0


def settings_tables() -> dict[str, str]:
    """{section path: markdown table of its settings}, every section of a Serve app's args."""
    from pydantic import BaseModel

    from engram_ray.serve.settings.config import ServeAppConfig

    tables, todo = {}, [("", ServeAppConfig)]
    while todo:
        prefix, model = todo.pop(0)
        for name, info in model.model_fields.items():
            if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
                todo.append((f"{prefix}{name}.", info.annotation))
        if prefix:
            tables[prefix.rstrip(".")] = settings_table(model)
    return tables


def settings_table(model) -> str:
    """A section's settings: field, default (`unset` for None, `see below` for a section) and
    its description."""
    rows = ["| field | default | meaning |", "| --- | --- | --- |"]
    for name, info in model.model_fields.items():
        rows.append(f"| `{name}` | {_default_cell(info)} | "
                    + info.description.replace("|", "\\|") + " |")
    return "\n".join(rows)


def _default_cell(info) -> str:
    from pydantic import BaseModel

    default = info.get_default(call_default_factory=True)
    if isinstance(default, BaseModel):
        return "see below"
    if default is None:
        return "unset"
    is_scalar = isinstance(default, (str, int, float)) and not isinstance(default, bool)
    return f"`{default if is_scalar else json.dumps(default)}`"


def with_tables(text: str, source: str) -> tuple[str, list[str]]:
    """`text` with the table after each section's marker (blank lines between them kept)
    replaced by the generated one, and the sections whose table that changed. A section's
    marker missing or twice, or a marker naming no section, is an error naming it."""
    tables = settings_tables()
    lines, stale = text.split("\n"), []
    found = [line.strip() for line in lines if line.strip().startswith(MARKER.split("{}")[0])]
    unknown = [m for m in found if m not in {MARKER.format(name) for name in tables}]
    if unknown:
        raise EngramRayError(f"tables: {source} has {unknown[0]!r}, a marker of no section "
                             f"(the sections: {', '.join(tables)})")
    for name, table in tables.items():
        marker = MARKER.format(name)
        if found.count(marker) != 1:
            raise EngramRayError(f"tables: {source} has the line {marker!r} "
                                 f"{found.count(marker)} times (once: the line before the "
                                 f"table of {name})")
        start = next(i for i, line in enumerate(lines) if line.strip() == marker) + 1
        while start < len(lines) and not lines[start].strip():
            start += 1
        end = start
        while end < len(lines) and lines[end].lstrip().startswith("|"):
            end += 1
        if lines[start:end] != table.split("\n"):
            lines[start:end] = table.split("\n")
            stale.append(name)
    return "\n".join(lines), stale


def app_args_schema() -> dict:
    """`ServeAppConfig`'s schema, plus the `group` a group application's args carry
    (`engram_ray.serve.settings.group_apps.group_args`)."""
    from engram_ray.serve.settings.config import ServeAppConfig

    schema = ServeAppConfig.model_json_schema()
    schema["properties"]["group"] = {
        "type": "string", "pattern": "^group-[0-9]+$",
        "description": "the peer group of a group application (engram_ray.serve.app:build_group"
                       "), group-<i>; not in the front door's (build_app) args"}
    return {"$schema": SCHEMA_DIALECT, **schema, "title": "engram-ray Serve application args"}
