"""``rope-patch inspect [MODEL] [--method SPEC]``: a model's rotary set-up, pair by pair, before and after a method."""

from __future__ import annotations

import argparse

from ..methods import available_methods, parse_method_spec
from ..rotary_info import describe_rotary, format_report, frequency_table, load_structure
from .common import add_config_argument


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "inspect",
        help="show a model's RoPE set-up and each frequency pair before/after a method",
        description="Show the rotary set-up of MODEL (type, head and rotary dims, pairing, base, native length, "
        "current scaling) and, per frequency pair, its wavelength and how many turns it makes within the native "
        "window, before and after --method. Only the config and RoPE buffers are loaded, not the weights.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"methods: {', '.join(available_methods())}\n"
        "example: rope-patch inspect HuggingFaceTB/SmolLM2-135M --method yarn:factor=4",
    )
    parser.add_argument("model", nargs="?", default=None,
                        help="hub id or local folder (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--method", metavar="SPEC", default=None,
                        help="method to compare with, NAME[:key=value,...], e.g. yarn:factor=2")
    add_config_argument(parser, example="configs/inspect.yaml")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    method, params = parse_method_spec(args.method) if args.method else (None, {})
    model = load_structure(args.model)
    info = describe_rotary(model)
    rows, factor = frequency_table(info, method, params)
    print(format_report(info, rows, method, params, factor))
    return 0
