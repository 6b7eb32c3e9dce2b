"""The quickstart config on several seeds and thread counts: both validation splits, per run.

Each run is ``configs/quickstart.yaml`` through the CLI in its own subprocess with
``OMP_NUM_THREADS`` set; the thread count changes the order of floating-point sums, which stands
in for another machine (issue 40). Runs with ``t`` threads go ``cores // t`` at a time, so the
1-thread runs of a 2-core machine run in pairs (their step times are then per core, not alone).

Printed per run: held-out accuracy before -> after on the training instruction
(``val/accuracy``) and asked in other words (``val/accuracy_paraphrased``), the mean step time
and the wall time of the whole command; then the lowest of each column.

    python benchmarks/quickstart_runs.py                   # seeds 0,1,2 x threads 1,2 (six runs)
    python benchmarks/quickstart_runs.py --seeds 0 --threads 2
    python benchmarks/quickstart_runs.py --set=--model.init_args.rollout_mode=async  # a variant
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from cli_runs import fit

KEYS = ("val/accuracy", "val/accuracy_paraphrased")


def one(seed: int, threads: int, overrides: list[str], folder: Path) -> dict[str, float]:
    """One quickstart fit; validation before/after on both splits, step and wall time."""
    root = folder / f"seed{seed}-t{threads}"
    series, wall = fit("quickstart.yaml", root, [f"--seed_everything={seed}", *overrides], threads)
    row: dict[str, float] = {"seed": seed, "threads": threads, "wall_s": wall}
    for key in KEYS:
        values = series.get(key, [float("nan")])
        row[f"{key} before"], row[f"{key} after"] = values[0], values[-1]
    row["step_s"] = statistics.fmean(series.get("train/step_time_s", [float("nan")]))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--threads", default="1,2", help="OMP_NUM_THREADS values, each a run")
    parser.add_argument("--cores", type=int, default=2, help="cores to share between runs")
    parser.add_argument("--set", action="append", default=[], help="a CLI override, every run")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="quickstart-runs-") as tmp:
        for threads in (int(t) for t in args.threads.split(",")):
            with ThreadPoolExecutor(max(1, args.cores // threads)) as pool:
                jobs = [pool.submit(one, s, threads, args.set, Path(tmp)) for s in seeds]
                for job in jobs:
                    rows.append(job.result())
                    print(rows[-1], flush=True)
    print("| seed | threads | val/accuracy | val/accuracy_paraphrased | step s | wall s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        splits = [f"{r[f'{k} before']:.2f} → {r[f'{k} after']:.2f}" for k in KEYS]
        print(f"| {r['seed']} | {r['threads']} | {' | '.join(splits)} | {r['step_s']:.1f} | "
              f"{r['wall_s']:.0f} |")  # fmt: skip
    lows = [min(r[f"{k} after"] for r in rows) for k in KEYS]
    print(f"lowest after: val/accuracy {lows[0]:.2f}, val/accuracy_paraphrased {lows[1]:.2f}")


if __name__ == "__main__":
    main()
