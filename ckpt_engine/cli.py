"""``ckpt-engine`` command line."""

from __future__ import annotations

import argparse
import sys

from ckpt_engine import __version__
from ckpt_engine.config import load_config
from ckpt_engine.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ckpt-engine", description="versioned, verified weight sync for RL")
    parser.add_argument("--version", action="version", version=f"ckpt-engine {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="trainer + 2 receivers doing real syncs on this machine (demo --help for options)")
    check = sub.add_parser("check-config", help="validate a deployment YAML and print the effective settings")
    check.add_argument("path")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["demo"]:  # the demo parses its own options
        from ckpt_engine.examples.e2e import main as demo_main

        return demo_main(argv[1:])
    args = parser.parse_args(argv)
    try:
        config = load_config(args.path)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(config.model_dump_json(indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
