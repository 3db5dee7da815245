"""`stoker` command line: one entry point, subcommands registered by their packages.

Each module listed in `_COMMAND_MODULES` exposes `register(subparsers) -> None`, which adds
one or more top-level subcommands and sets `func` (a callable taking the parsed args and
returning an exit code) on each. Registration modules must stay light: heavy imports
(torch, fastapi, matplotlib) happen inside `func`, so `stoker --help` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from stoker import __version__

_COMMAND_MODULES: tuple[str, ...] = (
    "stoker.server.cli",  # serve
    "stoker.engine.cli",  # generate
    "stoker.bench.cli",  # bench throughput|serve|sweep|compare
    "stoker.roofline.cli",  # roofline, plan
    "stoker.fleet.cli",  # fleet plan
    "stoker.telemetry.cli",  # top, telemetry
    "stoker.doctor.cli",  # doctor
    "stoker.finetune.cli",  # finetune
    "stoker.router.cli",  # router
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stoker",
        description="Stoker: LLM inference serving that keeps the GPU fed and names the wall it is against.",
    )
    parser.add_argument("--version", action="version", version=f"stoker {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:  # a subsystem not built in this checkout
            if exc.name == module_name:
                continue
            raise
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # Before any subcommand imports torch: libgomp reads its wait policy when it loads.
    from stoker.cpu_runtime import configure_openmp

    configure_openmp()
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return int(func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `stoker ... | head`: the reader left; not an error
        sys.stderr.close()
        return 0
    except (ValueError, FileNotFoundError) as exc:
        # User errors (bad flags, missing files) get one clear line, not a traceback.
        print(f"stoker {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
