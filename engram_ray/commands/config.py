"""`engram-ray config schema`: the JSON schema of a Serve application's `args` (`deployment`,
`serving`, and a group application's `group`), made from the config models (`engram_ray.serve.config.ServeAppConfig`): every
setting with its type, bounds, default and description, unknown keys refused. Point an editor's
YAML support at it (completion and checks while typing), e.g.

    engram-ray config schema > engram-ray-args.schema.json

The checks across settings (a peer group holds whole data-parallel gangs, ...) and the names
vLLM and Ray Serve take (`engine_kwargs`, ...) are not in it: `engram-ray check` runs those.
"""

from __future__ import annotations

import json

HELP = "print the JSON schema of a Serve app's args (deployment, serving) for editors"
SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"  # what pydantic writes


def configure(parser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("schema", help="print the JSON schema of the args on stdout",
                   description="print the JSON schema of a Serve application's args "
                               "(deployment, serving) on stdout")


def run(args) -> int:
    print(json.dumps(app_args_schema(), indent=2))
    return 0


def app_args_schema() -> dict:
    """`ServeAppConfig`'s schema, plus the `group` a group application's args carry
    (`engram_ray.serve.app.group_args`)."""
    from engram_ray.serve.config import ServeAppConfig

    schema = ServeAppConfig.model_json_schema()
    schema["properties"]["group"] = {
        "type": "string", "pattern": "^group-[0-9]+$",
        "description": "the peer group of a group application (engram_ray.serve.app:build_group"
                       "), group-<i>; not in the front door's (build_app) args"}
    return {"$schema": SCHEMA_DIALECT, **schema, "title": "engram-ray Serve application args"}
