"""Any `shoal bench` at a baseline revision and on this checkout, in one run,
rounds alternating (a shared machine's memory read rate drifts over minutes,
so only neighbouring rounds compare):

    python -m shoal.benchmarks.ab REV ROUNDS OUTDIR -- bench offline --peers none

Each run's output goes to OUTDIR/{baseline,current}_N.log and its JSON (the
bench's --output) to OUTDIR/{baseline,current}_N.json."""

from __future__ import annotations

import os
import subprocess
import sys

from shoal.benchmarks.baseline_tree import baseline_and_current


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 5 or argv[3] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    rev, rounds, out, command = argv[0], int(argv[1]), argv[2], argv[4:]
    os.makedirs(out, exist_ok=True)
    out = os.path.abspath(out)
    with baseline_and_current(rev) as trees:
        for r in range(1, rounds + 1):
            for side, path in trees.items():
                run = [sys.executable, "-m", "shoal.cluster.cli", *command, "--output", f"{out}/{side}_{r}.json"]
                with open(f"{out}/{side}_{r}.log", "w") as log:
                    rc = subprocess.run(
                        run, env=dict(os.environ, PYTHONPATH=path), cwd=path, stdout=log, stderr=subprocess.STDOUT
                    ).returncode
                print(f"{side} {r}: exit {rc}, {out}/{side}_{r}.log", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
