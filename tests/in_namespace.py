"""Real full disks and read-only folders for the fault tests, without root on the host: ``rope-patch`` commands run
on a small tmpfs mounted in a user namespace (``unshare --user --map-root-user --mount``), in one Python process per
test, and report back each command's exit code, its stderr and the files on the tmpfs.

A step is ``["cli", argv]`` (``{mount}`` in an argument is the tmpfs), ``["remount_ro"]`` (the tmpfs becomes
read-only; ``["remount_ro", name]``: the one mounted at ``name``), ``["mount", name, size]`` (another tmpfs at
``name``, inside the first), ``["fill", name, free_bytes]`` (a file that leaves about ``free_bytes`` free) or ``["remove", name]``. Where user namespaces are
not permitted, :func:`namespace_refusal` says why and the tests skip.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT = "NAMESPACE-RESULT "


@functools.cache
def namespace_refusal() -> str | None:
    """None where a tmpfs can be mounted in a user namespace here, else why not (the reason the test skips)."""
    if shutil.which("unshare") is None:
        return "no unshare command"
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                            "d=$(mktemp -d) && mount -t tmpfs -o size=64k tmpfs \"$d\" && umount \"$d\"; rmdir \"$d\""],
                           capture_output=True, text=True)
    return None if probe.returncode == 0 else f"user namespaces with a tmpfs are not permitted: {probe.stderr.strip()}"


def run_on_tmpfs(mount: Path, size: str, steps: list, timeout: int = 600) -> list[dict]:
    """Mount a tmpfs of ``size`` at ``mount`` (an empty folder) in a new user and mount namespace and run ``steps``
    there; each step's ``{"code", "stderr", "files"}`` (files: every file on the tmpfs and its sha256)."""
    mount.mkdir(parents=True, exist_ok=True)
    script = 'mount -t tmpfs -o "size=$1" tmpfs "$2" && exec "$3" "$4" "$5"'
    run = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, "sh", size,
                          str(mount), sys.executable, __file__, json.dumps({"mount": str(mount), "steps": steps})],
                         capture_output=True, text=True, timeout=timeout,
                         env=os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"),
                                                                                       str(ROOT)])),
                                           "TOKENIZERS_PARALLELISM": "false"})
    lines = [line for line in run.stdout.splitlines() if line.startswith(RESULT)]
    assert run.returncode == 0 and lines, f"the namespace run failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return json.loads(lines[-1][len(RESULT):])


def files_on(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (the lock files left out: they hold who last wrote) and a hash of its bytes."""
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".rope-patch.lock"}


def _inside(plan: dict) -> None:
    from rope_patch.cli import main

    mount = Path(plan["mount"])
    results = []
    for step in plan["steps"]:
        code, err = 0, io.StringIO()
        if step[0] == "cli":
            argv = [a.replace("{mount}", str(mount)) for a in step[1]]
            with contextlib.redirect_stderr(err):
                try:
                    code = main(argv)
                except BaseException:  # what the test must report: a traceback instead of one line
                    traceback.print_exc()
                    code = "raised"
        elif step[0] == "remount_ro":
            subprocess.run(["mount", "-o", "remount,ro", str(mount / step[1]) if len(step) > 1 else str(mount)],
                           check=True)
        elif step[0] == "mount":
            (mount / step[1]).mkdir(parents=True, exist_ok=True)
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={step[2]}", "tmpfs", str(mount / step[1])], check=True)
        elif step[0] == "fill":
            free = shutil.disk_usage((mount / step[1]).parent).free  # the file system the file goes on
            with open(mount / step[1], "wb") as f:
                f.write(b"\0" * max(free - step[2], 0))
        elif step[0] == "remove":
            (mount / step[1]).unlink()
        results.append({"code": code, "stderr": err.getvalue(), "files": files_on(mount)})
    print(RESULT + json.dumps(results), flush=True)


if __name__ == "__main__":
    _inside(json.loads(sys.argv[1]))
