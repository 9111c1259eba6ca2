"""Build the embedded corpus's snapshot (rope_patch/data/stdlib_corpus/) from a CPython 3.11 standard library.

The corpus used to be read from whichever Python ran rope_patch, so its texts (and every table measured on it) moved
with the interpreter: on 3.12 and 3.13 ``datetime.py`` is a 268-byte shim over ``_pydatetime.py``. The snapshot is
the 3.11.7 library's texts, fixed: ``pydoc_data/topics.py``'s topic help joined into one prose document, then the 16
largest modules (by file size, then name), each stored under its document id in ``corpus.tar.xz``, with CPython's
license beside them. ``rope_patch.data.documents.STDLIB_SHA256`` pins each text's hash; this script rebuilds the
archive and refuses to write one whose texts differ from those hashes.

    python scripts/make_stdlib_corpus.py            # on CPython 3.11.7: rewrites the archive and LICENSE.txt
"""

from __future__ import annotations

import hashlib
import io
import shutil
import sys
import sysconfig
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rope_patch.data.documents import SNAPSHOT, STDLIB_MODULES, STDLIB_SHA256, topics_prose  # noqa: E402


def texts_from_running_python() -> dict[str, str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    from pydoc_data.topics import topics

    texts = {"pydoc_data/topics.py": topics_prose(topics)}
    modules = sorted(stdlib.glob("*.py"), key=lambda p: (-p.stat().st_size, p.name))[:STDLIB_MODULES]
    texts |= {p.name: p.read_text(encoding="utf-8") for p in modules}
    return texts


def main() -> int:
    texts = texts_from_running_python()
    got = {name: hashlib.sha256(text.encode()).hexdigest() for name, text in texts.items()}
    if got != STDLIB_SHA256:
        print(f"make_stdlib_corpus: this Python's library ({sys.version.split()[0]}) differs from the pinned "
              "snapshot; run it on CPython 3.11.7", file=sys.stderr)
        return 2
    buffer = io.BytesIO()
    # fixed metadata, so the archive is the same bytes on every run
    with tarfile.open(fileobj=buffer, mode="w:xz", format=tarfile.PAX_FORMAT) as archive:
        for name, text in texts.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            archive.addfile(info, io.BytesIO(data))
    SNAPSHOT.write_bytes(buffer.getvalue())
    shutil.copyfile(Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt", SNAPSHOT.parent / "LICENSE.txt")
    print(f"wrote {SNAPSHOT.relative_to(ROOT)} ({SNAPSHOT.stat().st_size:,} bytes, {len(texts)} documents)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
