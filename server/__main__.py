"""``python -m ckpt_engine.server serve --config PATH``: the daemon alone (``ckpt-engine serve`` runs the same;
the rest of the command line lives in cli/, which the daemon does not import)."""

import argparse
import sys

from ckpt_engine.config import load_config
from ckpt_engine.errors import ConfigError
from ckpt_engine.server.daemon import serve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ckpt_engine.server", description="the ckpt-engine daemon")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="run the daemon").add_argument(
        "--config", required=True, help="deployment YAML, e.g. deploy/engine.yaml")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return serve(config)


if __name__ == "__main__":
    sys.exit(main())
