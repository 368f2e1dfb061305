"""One sitting, interleaved: graphile-worker's drain (../shared/peers harness)
and flow's drain (benches/bench.py's `drain`), round by round, so background
load hits both alike. Prints each round and the ratio of the medians.

    bash tools/setup.sh && /var/tmp/flow-venv/bin/python benches/sitting.py [ROUNDS]
"""
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402

PEERS = bench.PEERS


def graphile_drain(round_):
    done = subprocess.run([str(PEERS / "graphile-worker" / "run.sh"), "drain", str(round_)],
                          capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    return json.loads(lines[-1][len("RESULT "):])["drain_rate"] if lines else None


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    subprocess.run([str(PEERS / "pg.sh"), "start"], check=True, capture_output=True)
    pg = bench.start(2)
    out = {"graphile-worker": [], "flow.noop": [], "plpgsql no-op": []}
    try:
        for r in range(1, rounds + 1):
            out["graphile-worker"].append(graphile_drain(r))
            out["flow.noop"].append(bench.drain(pg, "rust_noop"))
            out["plpgsql no-op"].append(bench.drain(pg, "plpgsql_noop"))
            print(f"round {r}: " + ", ".join(f"{k} {v[-1]:,.0f}" for k, v in out.items() if v[-1]), flush=True)
    finally:
        pg.stop()
        subprocess.run([str(PEERS / "pg.sh"), "stop"], capture_output=True)
    peer = statistics.median(v for v in out["graphile-worker"] if v)
    for name in ("flow.noop", "plpgsql no-op"):
        print(f"{name}: median {statistics.median(out[name]):,.0f} jobs/s = "
              f"x{statistics.median(out[name]) / peer:.2f} graphile-worker ({peer:,.0f} jobs/s)")


if __name__ == "__main__":
    main()
