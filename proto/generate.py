"""Generate the Python stubs from the .proto files: `python -m shoal.proto.generate`.

protoc sees proto/ as `shoal/proto/`, so the generated modules import each
other as `shoal.proto.v1...`, the package they are installed under.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
PROTOS = ["v1/shoal.proto"]
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out_dir: str) -> list[str]:
    """Write the stubs of every .proto under out_dir (mirroring proto/); return their paths."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-Ishoal/proto={HERE}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
        ] + [f"shoal/proto/{p}" for p in PROTOS]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed: " + " ".join(args))
        written = []
        for p in PROTOS:
            stem = p[: -len(".proto")]
            for suffix in SUFFIXES:
                rel = stem + suffix
                dst = os.path.join(out_dir, rel)
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                shutil.copyfile(os.path.join(tmp, "shoal", "proto", rel), dst)
                written.append(dst)
        return written


if __name__ == "__main__":
    for path in generate(sys.argv[1] if len(sys.argv) > 1 else HERE):
        print(path)
