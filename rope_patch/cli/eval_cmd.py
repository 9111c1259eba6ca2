"""``rope-patch eval``: long-context perplexity of several methods at several lengths, in one resumable run."""

from __future__ import annotations

import argparse

from ..errors import ConfigError
from ..methods import available_methods
from ..patching import AS_LOADED
from ..perplexity import run_eval
from .common import add_config_argument, add_model_and_method_arguments, int_list


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="perplexity of several methods at several lengths (tables, CSV/JSON, plots)",
        description="Load the model once, patch in each method, score the same token windows at every length, and "
        "report token-weighted perplexity with a 95%% bootstrap interval over documents. Protocols: truncate (each "
        "document cut to its first L tokens, one forward) or sliding (every token scored once with up to L tokens "
        "of context). Documents shorter than the longest length are skipped and counted. Each finished "
        "(method, length, document) is saved at once: rerun the same command to resume. Under 'accelerate launch' "
        "the windows are split across processes.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"methods: {', '.join(available_methods())}, {AS_LOADED}\n"
        "example: rope-patch eval --method none --method yarn:factor=2 --lengths 4096,8192,16k --documents 4",
    )
    add_model_and_method_arguments(parser)
    parser.add_argument("--lengths", default=[4096, 8192, 16384],
                        help="window lengths in tokens, e.g. 4096,8192,16k (default: 4096,8192,16384)")
    parser.add_argument("--dataset", default=None,
                        help="hub data set name, or a local .txt/.jsonl/.parquet file or folder "
                        "(default: the embedded corpus built from the Python standard library)")
    parser.add_argument("--split", default=None, help="split of a hub data set (default: test)")
    parser.add_argument("--subset", default=None, help="configuration name of a hub data set, if it has several")
    parser.add_argument("--text-field", default="text", help="field holding the text in .jsonl/.parquet/hub rows")
    parser.add_argument("--protocol", choices=("truncate", "sliding"), default="truncate",
                        help="truncate: first L tokens of each document, one forward; sliding: windows of L tokens "
                        "advancing by --stride, each token scored once (default: truncate)")
    parser.add_argument("--stride", type=int, default=256, help="stride of the sliding protocol (default: 256)")
    parser.add_argument("--documents", type=int, default=None,
                        help="evaluate this many documents, sampled with --seed (default: all long enough)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the document sample (default: 0)")
    parser.add_argument("--batch-size", type=int, default=1, help="windows per forward (default: 1)")
    parser.add_argument("--dtype", default="auto",
                        help="auto (bf16 on GPU, fp32 on CPU), bf16, fp32 or fp16 (default: auto)")
    parser.add_argument("--bos", choices=("auto", "yes", "no"), default="auto",
                        help="start every window with the BOS token: auto follows the tokenizer (default: auto)")
    parser.add_argument("--loss-chunk", type=int, default=1024,
                        help="tokens per slice through the output head; full-vocabulary logits never exist for "
                        "more (default: 1024)")
    parser.add_argument("--output", default="runs/eval",
                        help="folder for results.jsonl (resumable), summary.csv/.json and plots (default: runs/eval)")
    add_config_argument(parser, example="configs/eval/demo.yaml")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    methods = args.method if isinstance(args.method, list) else [args.method]
    if args.bos not in ("auto", "yes", "no", True, False):
        raise ConfigError(f"bos {args.bos!r}: use auto, yes or no")
    result = run_eval(
        args.model, methods=methods, lengths=int_list(args.lengths), dataset=args.dataset, split=args.split,
        text_field=args.text_field, subset=args.subset, protocol=args.protocol, stride=args.stride,
        documents=args.documents, seed=args.seed, batch_size=args.batch_size, dtype=args.dtype,
        add_bos={"auto": None, "yes": True, "no": False}.get(args.bos, args.bos), loss_chunk=args.loss_chunk,
        output=args.output,
    )
    if result.files:  # only the main process reports under accelerate launch
        s = result.settings
        print(f"\nperplexity, {s['model']} ({s['dtype']}), native length {s['native_length']:,}, data {s['data']}")
        print(result.table)
        files = ", ".join(map(str, result.files.values()))
        print(f"\nresults: {args.output}/results.jsonl; summaries and plots: {files}")
    return 0
