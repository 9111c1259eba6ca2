"""``rope-patch passkey``: passkey retrieval over lengths × depths × trials for several methods in one run."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..methods import available_methods
from ..patching import AS_LOADED, method_entries
from .common import add_config_argument, add_model_and_method_arguments, float_list, int_list


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "passkey",
        help="passkey retrieval accuracy at long lengths, for several methods",
        description="Hide a random 5-digit key at chosen depths of filler text, ask the model for it with greedy "
        "decoding, and report accuracy per method × length × depth. Lengths count the model's own tokens. The "
        "model is loaded once and every method sees the same prompts. Each trial is saved the moment it finishes: "
        "rerun the same command to resume.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"methods: {', '.join(available_methods())}, {AS_LOADED}\n"
        "example: rope-patch passkey --method none --method yarn:factor=2 --lengths 4096,8192,16k --trials 5",
    )
    add_model_and_method_arguments(parser)
    parser.add_argument("--lengths", default=[4096, 8192, 16384],
                        help="prompt lengths in tokens, e.g. 4096,8192,16k (default: 4096,8192,16384)")
    parser.add_argument("--depths", default=[0.0, 0.25, 0.5, 0.75, 1.0],
                        help="key depths as fractions of the filler, 0 = start, 1 = end (default: 0,0.25,0.5,0.75,1)")
    parser.add_argument("--trials", type=int, default=5, help="trials (random keys) per length × depth (default: 5)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random keys (default: 0)")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="tokens generated per answer (default: 8)")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU), bf16, fp32 or fp16")
    parser.add_argument("--output", default="runs/passkey",
                        help="folder for results.jsonl (resumable), summary.csv/.json and plots (default: runs/passkey)")
    add_config_argument(parser, example="configs/passkey/demo.yaml")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..models import load_model
    from ..passkey import KEY_FIELDS, check_grid, run_passkey
    from ..passkey_report import format_table, write_reports
    from ..patching import native_length
    from ..results import ResultStore

    method_entries(None, args.method)  # a typo fails before the model loads
    lengths, depths = int_list(args.lengths), float_list(args.depths)
    check_grid(lengths, depths, args.trials, args.max_new_tokens)
    output = Path(args.output)
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    model_name = str(args.model or "SmolLM2-135M-Instruct (embedded)")
    store = ResultStore(output / "results.jsonl", KEY_FIELDS)
    if len(store):
        print(f"resuming: {len(store)} finished trials in {output / 'results.jsonl'}")

    records = run_passkey(
        model, tokenizer, args.method, lengths, depths, args.trials,
        seed=args.seed, max_new_tokens=args.max_new_tokens, store=store, model_name=model_name,
    )
    settings = {
        "model": model_name, "methods": [label for label, _, _ in method_entries(model, args.method)], "lengths": lengths,
        "depths": depths, "trials": args.trials, "seed": args.seed, "max_new_tokens": args.max_new_tokens,
        "dtype": str(args.dtype), "native_length": native_length(model),
    }
    print(f"\npasskey accuracy (correct/trials), {model_name}, native length {settings['native_length']:,}")
    print(format_table(records))
    if len(depths) > 1:
        print("\nby key depth (0 = start of the filler), all lengths pooled")
        print(format_table(records, by="depth"))
        print("\nby length and key depth (also in summary.csv and heatmaps.png)")
        print(format_table(records, by=("length", "depth")))
    files = write_reports(records, output, settings=settings, native_length=settings["native_length"])
    print(f"\nresults: {output / 'results.jsonl'}; summaries and plots: {', '.join(str(p) for p in files.values())}")
    return 0
