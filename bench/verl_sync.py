"""What a daemon adds to a verl sync: the ckpt_engine verl backend driven as verl 0.9.1's
CheckpointEngineManager drives it (tests/engines_verl/verl_harness.py: 1 actor rank and 2 rollout workers,
one process each, gloo), alone and with a daemon process, rounds alternating, side by side in one run.

    bash scripts/test-verl.sh --co -q   # once: builds .venv-verl
    .venv-verl/bin/python -m ckpt_engine.bench.verl_sync [--rounds 10]

The harness's model is small (13 tensors, about 200 KB): what is measured is the fixed cost of a sync, where
the daemon's part shows (numbering, reports, the verdict); bytes cost the same with or without it. Timed per
sync: the whole update_weights (prepare -> build_topology -> init_process_group -> send/receive -> finalize),
as verl's driver sees it. Medians; the ratio is with ÷ without.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from ckpt_engine.server.launch import REPO, start_daemon, write_config


def main(argv: list[str] | None = None) -> None:
    import sys

    sys.path.insert(0, str(REPO))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args(argv)
    from tests.engines_verl.verl_harness import Cluster

    daemon = start_daemon(write_config(Path(tempfile.mkdtemp()), transport="collective"))
    timeouts = {"timeout_s": 120.0, "load_timeout_s": 120.0}
    clusters = {"alone": Cluster(1, 2, timeouts), "with daemon": Cluster(1, 2, {"endpoint": daemon.zmq, **timeouts})}
    seconds: dict[str, list[float]] = {label: [] for label in clusters}
    try:
        for step in range(args.rounds + 1):  # the first round (group set-up, registration) is not counted
            order = list(clusters.items()) if step % 2 == 0 else list(reversed(clusters.items()))
            for label, cluster in order:
                started = time.perf_counter()
                sync = cluster.update_weights(step + 1)
                elapsed = time.perf_counter() - started
                failed = [r for r in sync["actors"] + sync["rollouts"] if "raised" in r]
                if failed:
                    raise SystemExit(f"{label}: sync {step + 1} failed: {failed[0]['raised']}")
                if step:
                    seconds[label].append(elapsed)
    finally:
        for cluster in clusters.values():
            cluster.close()
        daemon.stop()
    medians = {label: statistics.median(values) for label, values in seconds.items()}
    for label, median in medians.items():
        print(f"{label:>12}: update_weights median {median * 1e3:.1f} ms over {args.rounds} syncs "
              f"(min {min(seconds[label]) * 1e3:.1f}, max {max(seconds[label]) * 1e3:.1f})")
    print(f"{'ratio':>12}: {medians['with daemon'] / medians['alone']:.2f}x (with daemon / alone), "
          f"+{(medians['with daemon'] - medians['alone']) * 1e3:.1f} ms per sync")


if __name__ == "__main__":
    main()
