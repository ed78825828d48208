"""`engram-ray` console script: dispatches to `engram_ray.commands.<name>`.

Errors a user can cause print one line on stderr and exit with code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from engram_ray.commands import COMMANDS
from engram_ray.errors import EngramRayError

USAGE_ERROR = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's default also exits 2; keep it to one line
        self.exit(USAGE_ERROR, f"engram-ray: error: {message}\n")


def _command_name(argv: list[str]) -> str | None:
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = _Parser(prog="engram-ray", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    wanted = _command_name(argv)
    for name, module_name in COMMANDS.items():
        if wanted is not None and wanted != name and wanted in COMMANDS:
            sub.add_parser(name)  # listed, but its module is not imported
            continue
        module = importlib.import_module(f"engram_ray.commands.{module_name}")
        module.configure(sub.add_parser(name, help=module.HELP, description=module.HELP))
        sub.choices[name].set_defaults(func=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        return args.func(args) or 0
    except EngramRayError as exc:
        print(f"engram-ray {args.command}: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
