"""python -m resilience.data.prepare --out DIR: build (or reuse) the token file and say where, how big, which."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from resilience.data.tokens import prepare_tokens, token_info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m resilience.data.prepare", description=__doc__)
    parser.add_argument("--out", type=Path, required=True, help="folder of the token file and its sidecar")
    parser.add_argument("--max-bytes", type=int, default=4_000_000, help="at most this many tokens (bytes)")
    args = parser.parse_args(argv)
    try:
        path = prepare_tokens(args.out, args.max_bytes)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    info = token_info(path)
    print(f"tokens: {path} ({info['size']} bytes, sha256 {info['sha256']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
