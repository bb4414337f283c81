"""The `handgrad` command: one entry point, one verb per job."""
import argparse
import sys


def _cmd_verify(args):
    from .verify import main as verify_main
    return verify_main(backend=args.backend, as_json=args.json)


def _cmd_bench(args):
    from .bench import main as bench_main
    return bench_main(args)


def build_parser():
    parser = argparse.ArgumentParser(prog="handgrad", description=__doc__)
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    p = sub.add_parser("verify", help="check every op and the whole model against PyTorch autograd")
    p.add_argument("--backend", default="cpu", choices=["cpu"], help="backend to verify (default cpu)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(func=_cmd_verify)

    from .bench import add_arguments as add_bench_arguments
    p = sub.add_parser("bench", help="time handgrad beside PyTorch on this machine")
    add_bench_arguments(p)
    p.set_defaults(func=_cmd_bench)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
