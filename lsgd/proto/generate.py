"""Regenerate ``lsgd/proto/lsgd_pb2*.py`` from ``protos/lsgd.proto``.

Usage::

    python -m lsgd.proto.generate            # write the generated modules
    python -m lsgd.proto.generate --check    # exit 1 if the committed modules are stale

Needs ``grpcio-tools`` (the ``dev`` extra).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROTO = REPO / "protos" / "lsgd.proto"
OUT = Path(__file__).resolve().parent
GENERATED = ("lsgd_pb2.py", "lsgd_pb2.pyi", "lsgd_pb2_grpc.py")


def generate(out_dir: Path) -> None:
    """Run protoc on the .proto into ``out_dir``, with the package-relative import fixed."""
    from grpc_tools import protoc  # dev-only dependency

    args = [
        "protoc",
        f"-I{PROTO.parent}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(PROTO),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO}")
    grpc_file = out_dir / "lsgd_pb2_grpc.py"
    text = grpc_file.read_text()
    grpc_file.write_text(text.replace("import lsgd_pb2 as lsgd__pb2", "from . import lsgd_pb2 as lsgd__pb2"))


def stale_files() -> list[str]:
    """Return the generated files whose content differs from a fresh generation."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        return [n for n in GENERATED if (Path(tmp) / n).read_bytes() != (OUT / n).read_bytes()
                ] if all((OUT / n).exists() for n in GENERATED) else list(GENERATED)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check, write nothing")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        if stale:
            print(f"stale generated code: {', '.join(stale)}; run: python -m lsgd.proto.generate",
                  file=sys.stderr)
            return 1
        return 0
    generate(OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
