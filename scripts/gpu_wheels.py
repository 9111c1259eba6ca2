"""The wheels ``scripts/check_gpu.sh`` carries to a GPU machine that has no internet.

The GPU machine has torch (CUDA build), transformers, accelerate and peft; rope_patch goes on ``PYTHONPATH``. What the
CUDA tests and the benchmarks import beyond those comes as wheels in one folder, downloaded here with pip's own index
configuration and installed there without any index:

    python scripts/gpu_wheels.py download gpu-wheels        # here (make gpu-wheels): pip download --no-deps
    python scripts/gpu_wheels.py install gpu-wheels SITE    # there (check_gpu.sh): only what is missing, into SITE

Versions are those installed in the environment that runs ``download`` (the ones tested here), for CPython
``--python-version`` (3.12, the GPU machine's) on manylinux x86_64. ``install`` puts a wheel into SITE (a folder
put first on ``PYTHONPATH``) only when the machine cannot import its module, so the machine's own builds stay.
pyarrow (55 MB) is not carried: with it the folder would pass the 64 MiB a transfer takes. rope_patch imports
``datasets`` (and so pyarrow) only where it reads a local file or a hub data set; the benchmarks and the embedded
corpus need neither. ``install`` says in one line where it is missing.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

# distribution -> the module it provides (what ``install`` checks the machine for)
WHEELS = {
    # the tests, the kernels, the data and export paths of rope_patch
    "pytest": "pytest", "pluggy": "pluggy", "iniconfig": "iniconfig", "hypothesis": "hypothesis",
    "sortedcontainers": "sortedcontainers", "liger-kernel": "liger_kernel", "gguf": "gguf", "pyyaml": "yaml",
    "datasets": "datasets", "dill": "dill", "multiprocess": "multiprocess", "xxhash": "xxhash",
    # pandas (datasets) and matplotlib (rope_patch.eval.plots), where the machine lacks them
    "pandas": "pandas", "python-dateutil": "dateutil", "pytz": "pytz", "six": "six",
    "matplotlib": "matplotlib", "contourpy": "contourpy", "cycler": "cycler", "fonttools": "fontTools",
    "kiwisolver": "kiwisolver", "pyparsing": "pyparsing", "pillow": "PIL",
}
NOT_CARRIED = {"pyarrow": "pyarrow"}  # 55 MB: only reading a local file or hub data set needs it (datasets)
BUDGET_MIB = 64
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_24_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_28_x86_64")


def normalized(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def download(folder: Path, python_version: str) -> int:
    """pip download --no-deps of every wheel in WHEELS at this environment's version; prints the folder's size."""
    folder.mkdir(parents=True, exist_ok=True)
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in WHEELS]
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
               python_version, *platforms, "--dest", str(folder), *pins]
    result = subprocess.run(command)
    if result.returncode != 0:
        print(f"gpu_wheels: pip download failed (exit {result.returncode}): {' '.join(pins)}", file=sys.stderr)
        return result.returncode
    size = sum(f.stat().st_size for f in folder.glob("*.whl"))
    print(f"{len(list(folder.glob('*.whl')))} wheels, {size / 2**20:.1f} MiB in {folder} (budget {BUDGET_MIB} MiB)")
    if size > BUDGET_MIB * 2**20:
        print(f"gpu_wheels: {size / 2**20:.1f} MiB is over the {BUDGET_MIB} MiB budget", file=sys.stderr)
        return 1
    return 0


def install(folder: Path, site: Path) -> int:
    """Install into ``site`` the wheels whose module this Python cannot import; one line per outcome."""
    wheels = {normalized(w.name.split("-")[0]): w for w in folder.glob("*.whl")}
    missing = [name for name, module in WHEELS.items() if importlib.util.find_spec(module) is None]
    absent = [name for name in missing if name not in wheels]
    chosen = [wheels[name] for name in missing if name in wheels]
    if chosen:
        command = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--disable-pip-version-check",
                   "--quiet", "--target", str(site), *map(str, chosen)]
        if subprocess.run(command, env={**os.environ, "PIP_ROOT_USER_ACTION": "ignore"}).returncode != 0:
            print(f"gpu_wheels: pip install --no-index of {', '.join(w.name for w in chosen)} failed", file=sys.stderr)
            return 1
    print(f"installed into {site}: {', '.join(n for n in missing if n in wheels) or 'nothing (all present)'}")
    lacking = absent + [name for name, module in NOT_CARRIED.items() if importlib.util.find_spec(module) is None]
    if lacking:
        print(f"gpu_wheels: this machine lacks {', '.join(lacking)} and {folder} has no wheel for it: the stages that "
              "import it fail (run make gpu-wheels here, or install it there)", file=sys.stderr)
        return 1
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    down = sub.add_parser("download", help="here: pip download the wheels into FOLDER")
    down.add_argument("folder", type=Path)
    down.add_argument("--python-version", default="3.12", help="the GPU machine's CPython (default 3.12)")
    put = sub.add_parser("install", help="on the GPU machine: install the missing ones into SITE")
    put.add_argument("folder", type=Path)
    put.add_argument("site", type=Path)
    args = parser.parse_args()
    if args.command == "download":
        return download(args.folder, args.python_version)
    return install(args.folder, args.site)


if __name__ == "__main__":
    sys.exit(main())
