"""Regenerate the Python code for proto/cbd/v1/cbd.proto into client/cbd_client/v1.

    python proto/generate.py            # write the generated files
    python proto/generate.py --check    # exit 1 if the committed files differ from a fresh generation

Needs grpcio-tools (pinned in pyproject's `dev` extra so the output is reproducible).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_DIR = ROOT / "proto"
PROTO = "cbd/v1/cbd.proto"
TARGET = ROOT / "client" / "cbd_client" / "v1"
FILES = ("cbd_pb2.py", "cbd_pb2.pyi", "cbd_pb2_grpc.py")


def generate(out: Path) -> dict[str, str]:
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc", f"-I{PROTO_DIR}", f"-I{include}",
        f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}", PROTO,
    ]  # fmt: skip
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    texts = {name: (out / "cbd" / "v1" / name).read_text() for name in FILES}
    # protoc writes absolute imports from the proto's own path; the code lives in cbd_client.v1.
    texts["cbd_pb2_grpc.py"] = texts["cbd_pb2_grpc.py"].replace(
        "from cbd.v1 import cbd_pb2 as", "from cbd_client.v1 import cbd_pb2 as"
    )
    return texts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        texts = generate(Path(tmp))
    if args.check:
        stale = [n for n, t in texts.items() if not (TARGET / n).exists() or (TARGET / n).read_text() != t]
        if stale:
            print(f"generated code is stale: {stale}; run python proto/generate.py", file=sys.stderr)
            return 1
        return 0
    TARGET.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        (TARGET / name).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
