"""``ckpt-engine`` command line: the daemon (``serve``), a client for its HTTP API, the demo, config checks."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx

from ckpt_engine import __version__
from ckpt_engine.config import load_config
from ckpt_engine.control.messages import TERMINAL
from ckpt_engine.errors import ConfigError
from ckpt_engine.plan.modes import STAGINGS
from ckpt_engine.server.console import printable, progress_line, status_lines, version_lines
from ckpt_engine.server.decisions.views import receiver_name

DEFAULT_URL = "http://127.0.0.1:8765"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["demo"]:  # the demos parse their own options
        from ckpt_engine.demos.fully_async import main as demo_main

        return demo_main(argv[1:])
    if argv[:1] == ["demo-library"]:
        from ckpt_engine.demos.library import main as library_demo_main

        return library_demo_main(argv[1:])
    if argv[:1] == ["bench"]:  # the benchmark suite and the fault trials parse their own options
        return _bench(argv[1:])
    if argv[:1] == ["chaos"]:
        from ckpt_engine.trials.chaos import main as chaos_main

        return chaos_main(argv[1:], prog="ckpt-engine chaos")
    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except httpx.HTTPError as exc:
        print(f"error: cannot reach the daemon at {args.url}: {exc}", file=sys.stderr)
        return 3


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ckpt-engine", description="versioned, verified weight sync for RL")
    parser.add_argument("--version", action="version", version=f"ckpt-engine {__version__}")
    parser.add_argument("--url", default=os.environ.get("CKPT_ENGINE_URL", DEFAULT_URL), help="daemon HTTP address")
    parser.add_argument("--token", default=os.environ.get("CKPT_ENGINE_TOKEN"),
                        help="bearer token (default: $CKPT_ENGINE_TOKEN, else the credentials file's token for the "
                             "command: operator, or rollout for vllm-driver)")
    parser.add_argument("--credentials", default=None,
                        help="credentials file the daemon wrote (default: $CKPT_ENGINE_CREDENTIALS, else "
                             "~/.ckpt-engine/credentials.json)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="the fully-async demo: daemon + 2-rank FSDP2 trainer + 2 rollouts (demo --help)")
    sub.add_parser("demo-library", help="the library alone: a trainer and 2 receivers, no daemon")
    sub.add_parser("bench", help="the benchmark suite (bench/), writes docs/benchmarks.md (bench --help)")
    sub.add_parser("chaos", help="randomized fault trials against a real cluster (chaos --help)")
    serve = sub.add_parser("serve", help="run the daemon")
    serve.add_argument("--config", required=True, help="deployment YAML, e.g. deploy/engine.yaml")
    serve.set_defaults(run=_serve)
    sync = sub.add_parser("sync", help="start a new version")
    sync.add_argument("--step", type=int)
    sync.add_argument("--bypass-cpu", action=argparse.BooleanOptionalAction, default=None,
                      help="override the deployment's bypass_cpu for this version")
    sync.add_argument("--sparse", action=argparse.BooleanOptionalAction, default=None,
                      help="send only what changed (--no-sparse: a whole version, whatever the deployment says)")
    sync.add_argument("--wait", action="store_true", help="show progress until the version ends")
    sync.add_argument("--timeout", type=float, default=600.0)
    sync.set_defaults(run=_sync)
    versions = sub.add_parser("versions", help="version history, newest first")
    versions.add_argument("--limit", type=int, default=20)
    versions.add_argument("--before", type=int, default=None, help="only versions older than this id (paging)")
    versions.add_argument("--status", choices=["requested", "snapshotting", "transferring", "verifying", *TERMINAL])
    _watch_options(versions)
    versions.set_defaults(run=_versions)
    for name, helptext, run in (("version", "one version's record", _version), ("push", "re-push a cached version",
                                _push), ("evict", "evict a version from the trainer's cache", _evict)):
        cmd = sub.add_parser(name, help=helptext)
        cmd.add_argument("id", type=int)
        cmd.set_defaults(run=run)
    status = sub.add_parser("status", help="the daemon, its trainer ranks, receivers (state, version served, lag, "
                                           "staging, last error), cache, and the version in flight")
    _watch_options(status)
    status.set_defaults(run=_status)
    driver = sub.add_parser("vllm-driver", help="drive a vLLM server's ckpt_engine weight-transfer backend: start "
                                              "its workers' receivers and apply each verified version")
    driver.add_argument("--vllm-url", required=True, help="the vLLM server (VLLM_SERVER_DEV_MODE=1), e.g. "
                                                          "http://127.0.0.1:8000")
    driver.add_argument("--endpoint", default=os.environ.get("CKPT_ENGINE_ENDPOINT", "tcp://127.0.0.1:8766"),
                        help="the daemon's ZMQ endpoint")
    driver.add_argument("--engine", default=None, help="this vLLM instance's name (default: vllm-<host>-<pid>)")
    driver.add_argument("--vllm-api-key", default=os.environ.get("VLLM_API_KEY"))
    driver.add_argument("--pause-mode", choices=["keep", "wait", "abort"], default="keep",
                        help="what vLLM does with requests in flight during an update (docs/workers.md)")
    driver.add_argument("--staging", choices=list(STAGINGS), default=None,
                        help="where the workers hold a version before it is applied (default: the deployment's; "
                             "docs/workers.md)")
    driver.add_argument("--sharded", action="store_true",
                        help="each worker receives only its tensor-parallel slices (vLLM served from a local model "
                             "directory; docs/workers.md)")
    driver.set_defaults(run=_vllm_driver)
    health = sub.add_parser("health", help="exit 0 if the daemon answers GET /health with ok (the image's "
                                         "HEALTHCHECK), 1 if it answers otherwise, 3 if it cannot be reached")
    health.add_argument("--config", default=None, help="the daemon's deployment YAML: ask its http.host and "
                                                        "http.port (default: --url)")
    health.add_argument("--timeout", type=float, default=5.0)
    health.set_defaults(run=_health)
    check = sub.add_parser("check-config", help="validate a deployment YAML and print the effective settings")
    check.add_argument("path")
    check.set_defaults(run=_check_config)
    return parser


def _interval(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.1 <= value <= 3600:  # (also false for nan)
        raise argparse.ArgumentTypeError(f"must be a number of seconds from 0.1 to 3600, got {text!r}")
    return value


def _watch_options(command: argparse.ArgumentParser) -> None:
    command.add_argument("--watch", action="store_true", help="redraw every --interval seconds until Ctrl-C")
    command.add_argument("--interval", type=_interval, default=1.0, help="seconds between frames (0.1 to 3600)")
    command.add_argument("--count", type=int, default=0, help="with --watch: stop after this many frames")


def _bench(argv: list[str]) -> int:
    """The benchmark suite (bench/, installed as ckpt_engine.bench; it checks for matplotlib first)."""
    from ckpt_engine.bench.suite import main as bench_main

    return bench_main(argv, prog="ckpt-engine bench")


def _serve(args: argparse.Namespace) -> int:
    from ckpt_engine.server.daemon import serve

    return serve(load_config(args.config))


def _vllm_driver(args: argparse.Namespace) -> int:
    """Until SIGINT/SIGTERM: the driver applies versions under vLLM's pause and keeps a torn engine paused."""
    import logging
    import signal
    import threading

    from ckpt_engine.workers.adapters.vllm import HttpControl, start_vllm_driver

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    from ckpt_engine.errors import CkptEngineError

    control = HttpControl(args.vllm_url, api_key=args.vllm_api_key, pause_mode=args.pause_mode)
    try:
        driver = start_vllm_driver(control, args.endpoint, engine=args.engine, token=args.token,
                                   credentials=args.credentials, staging=args.staging, sharded=args.sharded)
    except CkptEngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        control.close()
        return 2
    print(f"driving {args.vllm_url} as engine {driver.engine} (agent {driver.agent_id})", flush=True)
    stop.wait()
    driver.close()
    control.close()
    return 0


def _health(args: argparse.Namespace) -> int:
    """GET /health (no token). Exit 0 when it says ok, 1 when the daemon answers otherwise (503: its periodic work
    keeps failing, restart it), 3 when nothing answers (main() says so)."""
    if args.config is not None:
        args.url = health_url(load_config(args.config))
    response = httpx.get(f"{args.url}/health", timeout=args.timeout)
    try:
        body = response.json()
    except ValueError:
        body = {"ok": False, "problem": f"non-JSON reply: {response.text[:200]}"}
    healthy = response.status_code == 200 and isinstance(body, dict) and body.get("ok") is True
    print(f"{args.url}: {response.status_code} {json.dumps(body)}", file=sys.stdout if healthy else sys.stderr)
    return 0 if healthy else 1


def health_url(config: Any) -> str:
    """Where a process on the daemon's host reaches its HTTP API: the wildcard binds by loopback."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "[::]": "::1"}.get(config.http.host, config.http.host)
    host = host.strip("[]")
    return f"http://[{host}]:{config.http.port}" if ":" in host else f"http://{host}:{config.http.port}"


def _check_config(args: argparse.Namespace) -> int:
    from ckpt_engine.control.auth import check_credentials_path, credentials_path
    from ckpt_engine.server.authority import configured_tokens
    from ckpt_engine.server.history import HistoryError, check_history_path

    config = load_config(args.path)
    try:
        check_history_path(config.store.history_path)
        if not config.auth.open and not all(configured_tokens(config).values()):  # (else serve needs no file)
            check_credentials_path(credentials_path(config.auth.credentials_file))
    except HistoryError as exc:
        raise ConfigError(f"{args.path}: {exc}") from exc
    except ConfigError as exc:
        raise ConfigError(f"{args.path}: {exc}") from exc
    print(json.dumps(redacted(config.model_dump(mode="json")), indent=2))
    return 0


REDACTED = "<redacted>"


def redacted(settings: Any) -> Any:
    """Settings as check-config prints them: every token given (in the file or from the environment) replaced by
    ``<redacted>``, so the output can be pasted into a ticket; an unset one stays null (the daemon generates it)."""
    if isinstance(settings, dict):
        return {key: REDACTED if _secret(key) and value is not None else redacted(value)
                for key, value in settings.items()}
    if isinstance(settings, list):
        return [redacted(value) for value in settings]
    return settings


def _secret(key: str) -> bool:
    return key == "token" or key.endswith("_token")


def _client(args: argparse.Namespace) -> httpx.Client:
    from ckpt_engine.control.auth import CREDENTIALS_ENV, TOKEN_ENV, client_token, credentials_path

    named = args.credentials or os.environ.get(CREDENTIALS_ENV)
    if not (args.token or os.environ.get(TOKEN_ENV)) and named and not credentials_path(named).exists():
        # (a missing default file just means no token: the daemon's answer says what it wants)
        source = "--credentials" if args.credentials else f"${CREDENTIALS_ENV}"
        raise SystemExit(f"ckpt-engine: credentials file {credentials_path(named)} ({source}) does not exist: "
                         "give the file the daemon wrote (its log names it), or --token")
    token = client_token("operator", args.token, args.credentials)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=args.url, headers=headers, timeout=30.0)


def _call(args: argparse.Namespace, method: str, path: str, **kwargs: Any) -> tuple[int, dict]:
    with _client(args) as client:
        response = client.request(method, path, **kwargs)
    try:
        body = response.json()
    except ValueError:
        body = {"error": "non-JSON reply", "detail": response.text[:200]}
    if response.status_code >= 400:
        print(f"error {response.status_code}: {body.get('error')}: {body.get('detail')}", file=sys.stderr)
    return response.status_code, body


def _sync(args: argparse.Namespace) -> int:
    status, body = _call(args, "POST", "/sync", json={"step": args.step, "bypass_cpu": args.bypass_cpu,
                                                      "sparse": args.sparse})
    if status >= 400:
        return 1
    version = body["version"]
    print(f"version {version} requested")
    if not args.wait:
        return 0
    return _follow(args, version)


def _follow(args: argparse.Namespace, version: int) -> int:
    """Print each state the version passes through, then its summary."""
    deadline, last = time.monotonic() + args.timeout, None
    with _client(args) as client:
        while time.monotonic() < deadline:
            record = client.get(f"/versions/{version}").json()
            if record["status"] != last:
                last = record["status"]
                print(f"  {datetime.datetime.now():%H:%M:%S.%f}"[:-3] + f"  {last}")
            if last in TERMINAL:
                _print_record(record)
                return 0 if last == "committed" else 1
            time.sleep(0.05)
    print(f"version {version} did not end within {args.timeout}s", file=sys.stderr)
    return 1


def _versions(args: argparse.Namespace) -> int:
    params = {"limit": args.limit, **({"status": args.status} if args.status else {}),
              **({"before": args.before} if args.before else {})}
    if not args.watch:
        status, body = _call(args, "GET", "/versions", params=params)
        if status >= 400:
            return 1
        print("\n".join(version_lines(body["versions"])))
        return 0

    def frame(client: httpx.Client) -> list[str]:
        records = _get(client, "/versions", params)["versions"]
        return [progress_line(_get(client, "/status"), records, time.time()), "", *version_lines(records)]

    return _watch(args, frame)


def _version(args: argparse.Namespace) -> int:
    status, body = _call(args, "GET", f"/versions/{args.id}")
    if status >= 400:
        return 1
    _print_record(body)
    return 0


def _push(args: argparse.Namespace) -> int:
    status, body = _call(args, "POST", f"/versions/{args.id}/push")
    if status >= 400:
        return 1
    print(f"version {body['version']} re-pushes version {args.id}")
    return 0


def _evict(args: argparse.Namespace) -> int:
    status, _ = _call(args, "DELETE", f"/versions/{args.id}")
    if status >= 400:
        return 1
    print(f"version {args.id} evicted from the cache (history kept)")
    return 0


def _status(args: argparse.Namespace) -> int:
    def frame(client: httpx.Client) -> list[str]:
        records = _get(client, "/versions", {"limit": 50})["versions"]
        return status_lines(_get(client, "/status"), _get(client, "/receivers")["agents"], records, time.time())

    return _watch(args, frame)


def _get(client: httpx.Client, path: str, params: dict | None = None) -> dict:
    reply = client.get(path, params=params)
    if reply.status_code >= 400:
        raise CommandFailed(f"error {reply.status_code} from GET {path}: {reply.text[:200]}")
    return reply.json()


class CommandFailed(Exception):
    """The daemon refused a read a command needs (the message says which and why)."""


def _watch(args: argparse.Namespace, frame: Callable[[httpx.Client], list[str]]) -> int:
    """Print ``frame`` once, or (``--watch``) redraw it every ``--interval`` seconds until Ctrl-C or ``--count``
    frames; on a terminal each frame replaces the last. A watch outlives a daemon that is down, restarting or
    refusing: it says so, with the last frame's time, and tries again, backing off up to 30 s."""
    shown, redraw = 0, args.watch and sys.stdout.isatty()
    last_ok: float | None = None
    wait_s = args.interval
    try:
        with _client(args) as client:
            while True:
                try:
                    lines, last_ok, wait_s = frame(client), time.time(), args.interval
                except (CommandFailed, httpx.HTTPError) as exc:
                    if not args.watch:
                        raise
                    since = time.strftime("%H:%M:%S", time.localtime(last_ok)) if last_ok else "never"
                    wait_s = min(max(2 * wait_s, 1.0), 30.0)
                    lines = printable([f"daemon unreachable or refusing ({type(exc).__name__}: {exc}); last frame "
                                       f"{since}; trying again in {wait_s:.0f} s"])
                print(("\x1b[H\x1b[2J" if redraw else "") + "\n".join(lines), flush=True)
                shown += 1
                if not args.watch or (args.count and shown >= args.count):
                    return 0
                if not redraw:
                    print(flush=True)
                time.sleep(wait_s)
    except CommandFailed as exc:
        print(exc, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


def _print_record(r: dict) -> None:
    source = f", a re-push of version {r['source_version']}" if r.get("source_version") is not None else ""
    lines = [f"version {r['id']} ({r['mode']}, step {r['step']}{source}, {r.get('purpose', 'sync')}): {r['status']}"
             + (f" - {r['reason']}" if r["reason"] else ""),
             f"  {r['bytes'] / (1 << 20):.2f} MiB in {r['buckets']} bucket(s), {r['tensors_sent']} tensors; "
             f"digest {r['version_digest']}; cached: {'yes' if r['cached'] else 'no'}"]
    if r["stages"]:
        lines.append("  stages: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in r["stages"].items()))
    lines += [f"  {receiver_name(rx.get('rank'))} (agent {rx.get('agent_id')}): {'ok' if rx.get('ok') else 'FAILED'} "
              f"digest {rx.get('version_digest')}" + (f" - {rx['reason']}" if rx.get("reason") else "")
              for rx in r["receivers"]]
    print("\n".join(printable(lines)))


if __name__ == "__main__":
    sys.exit(main())
