"""``rope-patch finetune``: patch a model, train it at the new length, save a checkpoint that reloads anywhere.

The options are the fields of :class:`rope_patch.finetune.FinetuneConfig`, whose help texts are written once, there.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing

from ..errors import RopePatchError
from ..methods import available_methods
from .common import add_config_argument, int_list

LENGTH_OPTIONS = ("seq_len",)  # accept 16k for 16384
LIST_OPTIONS = ("lora_targets", "exclude_documents")  # comma-separated


def _one_length(text: str) -> int:
    try:
        values = int_list(text)
    except RopePatchError as error:  # argparse shows an ArgumentTypeError's own message
        raise argparse.ArgumentTypeError(str(error)) from None
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give one length, e.g. 16384 or 16k")
    return values[0]


def register(subparsers) -> None:
    from ..finetune import FinetuneConfig

    parser = subparsers.add_parser(
        "finetune",
        help="fine-tune a patched model at a longer context (full or LoRA; one device or many)",
        description="Patch the model's RoPE with --method, train it on sequences of exactly --seq-len tokens (documents "
        "joined by EOS) with AdamW and the Position Interpolation defaults, and save a standard transformers folder "
        "whose config carries the scaling. Runs on one process; for many GPUs start it with 'accelerate launch "
        "--config_file configs/accelerate/ddp.yaml -m rope_patch finetune ...'. Checkpoints every --save-every steps "
        "hold the optimizer, scheduler, data position and RNG: --resume continues to the same result.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"methods: {', '.join(available_methods())}\n"
        "example: rope-patch finetune --method linear:factor=2 --seq-len 16k --steps 200 --output runs/smollm2-16k",
    )
    hints = typing.get_type_hints(FinetuneConfig)
    for spec in dataclasses.fields(FinetuneConfig):
        flag, default, kind = "--" + spec.name.replace("_", "-"), spec.default, hints[spec.name]
        kwargs = {"help": spec.metadata["help"], "dest": spec.name}
        if "choices" in spec.metadata:
            kwargs["choices"] = spec.metadata["choices"]
        if kind is bool:
            kwargs.update(action=argparse.BooleanOptionalAction, default=default)
        elif spec.name == "resume":
            kwargs.update(nargs="?", const="latest", default=None, metavar="CHECKPOINT")
            kwargs["help"] += " (--resume alone means latest)"
        elif spec.name in LIST_OPTIONS:
            kwargs.update(default=",".join(spec.default_factory()), metavar="NAMES")
        else:
            base = next(t for t in typing.get_args(kind) or (kind,) if t is not type(None))
            kwargs.update(type=_one_length if spec.name in LENGTH_OPTIONS else base, default=default)
        if kwargs.get("default") not in (None, "") and kwargs.get("default") is not False:
            kwargs["help"] += " (default: %(default)s)"
        parser.add_argument(flag, **kwargs)
    add_config_argument(parser, example="configs/finetune/smollm2_16k_linear2.yaml")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..finetune import FinetuneConfig, finetune

    options = {f.name: getattr(args, f.name) for f in dataclasses.fields(FinetuneConfig)}
    finetune(FinetuneConfig(**options))
    return 0
