"""Command line: ``python -m parallelkittens demo`` (checks every op on 4 ranks) and
``python -m parallelkittens bench <name>`` (benchmarks beside their baselines)."""

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run the chosen job; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m parallelkittens")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run every primitive and op against PyTorch, print a table")
    demo.add_argument("--ranks", type=int, default=4)
    demo.add_argument("--backend", choices=["cuda", "cuda-shared", "cpu"], default=None)
    bench = sub.add_parser("bench", help="benchmark ours beside the baselines; JSON under bench/results/")
    bench.add_argument("name", help="which benchmark (see --list)", nargs="?")
    bench.add_argument("--list", action="store_true", help="list the benchmarks")
    bench.add_argument("--out", default="bench/results", help="folder for the JSON results")
    bench.add_argument("--plot", metavar="JSON", help="draw the PNG of an earlier result (needs matplotlib)")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run

        return run(args.ranks, args.backend)
    from .bench import BENCHMARKS, plot_record, run_benchmark

    if args.plot:
        import json

        with open(args.plot) as f:
            if plot_record(json.load(f), args.plot.removesuffix(".json") + ".png"):
                return 0
        print("no plot: this benchmark has none, or matplotlib is not installed", file=sys.stderr)
        return 1
    if args.list or not args.name:
        print("\n".join(f"{name:<15} {fn.__doc__.splitlines()[0]}" for name, fn in BENCHMARKS.items()))
        return 0
    return run_benchmark(args.name, args.out)


if __name__ == "__main__":
    sys.exit(main())
