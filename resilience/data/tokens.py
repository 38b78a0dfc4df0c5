"""A byte-level token file every machine can build offline: the Python standard library's own ``.py`` sources.

The bytes are the tokens (vocabulary 256). The file is written atomically beside a JSON sidecar holding its
sha256 and size, so that a later call reuses it only when it is whole and was built from the same source.
"""

from __future__ import annotations

import hashlib
import json
import platform
import sysconfig
from pathlib import Path

from resilience.record.fsio import atomic_write_bytes, atomic_write_json
from resilience.settings.checks import require_int

TOKENS = "tokens.bin"
SIDECAR = "tokens.json"
# Third-party code lives under the stdlib folder on some installs; it differs between machines, the stdlib does not.
_NOT_STDLIB = {"site-packages", "dist-packages"}


def stdlib_sources() -> list[Path]:
    """The standard library's ``.py`` files, in the order of their sorted relative paths."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if p.is_file() and not _NOT_STDLIB & set(p.relative_to(root).parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _source_bytes(max_bytes: int) -> bytes:
    chunks, size = [], 0
    for path in stdlib_sources():
        if size >= max_bytes:
            break
        data = path.read_bytes()[: max_bytes - size]
        chunks.append(data)
        size += len(data)
    return b"".join(chunks)


def _identity(max_bytes: int) -> dict[str, object]:
    # the stdlib, hence the bytes, changes with the Python release: a file built by another one is rebuilt
    return {"source": "python stdlib *.py", "python": platform.python_version(), "max_bytes": max_bytes}


def _reusable(path: Path, sidecar: Path, identity: dict[str, object]) -> bool:
    try:
        meta = json.loads(sidecar.read_text())
        data = path.read_bytes()
    except (OSError, ValueError):
        return False
    return (all(meta.get(k) == v for k, v in identity.items()) and meta.get("size") == len(data)
            and meta.get("sha256") == hashlib.sha256(data).hexdigest())


def prepare_tokens(out_dir: Path, max_bytes: int = 4_000_000) -> Path:
    """The token file in ``out_dir`` (built, or reused when its sidecar matches): the first ``max_bytes`` bytes of
    the stdlib's sources, one uint8 token per byte."""
    require_int("data.max_bytes", max_bytes, 1)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path, sidecar = out_dir / TOKENS, out_dir / SIDECAR
    identity = _identity(max_bytes)
    if _reusable(path, sidecar, identity):
        return path
    data = _source_bytes(max_bytes)
    if not data:
        raise ValueError(f"{sysconfig.get_paths()['stdlib']}: no .py sources found to build the token file from")
    atomic_write_bytes(path, data)
    # the sidecar last: a crash between the two leaves a file that the next call rebuilds, never a wrong match
    atomic_write_json(sidecar, {**identity, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    return path


def token_info(path: Path) -> dict[str, object]:
    """The sidecar of a token file built by ``prepare_tokens``."""
    return json.loads((Path(path).parent / SIDECAR).read_text())
