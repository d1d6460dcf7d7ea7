"""Regenerate the Python code of ``proto/*.proto``: ``python -m kvserve.proto.codegen``.

The ``.proto`` files are compiled as if they lived at ``kvserve/proto/`` so
that generated imports read ``from kvserve.proto import ..._pb2``; the
results are written next to the sources.  Generated files are never edited
by hand; ``--check`` exits non-zero when they are stale (a test runs it).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
VIRTUAL_PREFIX = "kvserve/proto"


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.glob("*.proto"))


def generate(out_dir: Path) -> dict[str, str]:
    """Compile every .proto; returns generated file name -> content."""
    import grpc_tools
    from grpc_tools import protoc

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"--proto_path={VIRTUAL_PREFIX}={PROTO_DIR}",
            f"--proto_path={include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
        ] + [f"{VIRTUAL_PREFIX}/{path.name}" for path in proto_files()]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed: " + " ".join(args))
        generated = Path(tmp) / VIRTUAL_PREFIX
        return {path.name: path.read_text() for path in sorted(generated.iterdir()) if path.is_file()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only report whether generated files are stale")
    args = parser.parse_args(argv)
    files = generate(PROTO_DIR)
    stale = [name for name, text in files.items()
             if not (PROTO_DIR / name).is_file() or (PROTO_DIR / name).read_text() != text]
    if args.check:
        for name in stale:
            print(f"stale: proto/{name} (run: python -m kvserve.proto.codegen)", file=sys.stderr)
        return 1 if stale else 0
    for name in stale:
        (PROTO_DIR / name).write_text(files[name])
        print(f"wrote proto/{name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
