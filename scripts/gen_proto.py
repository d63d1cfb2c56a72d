"""Regenerate the committed gRPC stubs from proto/ (run after editing a .proto).

    python scripts/gen_proto.py [OUT_DIR]

The stubs land in services/wire/ under the import path services.wire.diloco.v1,
so they import from an installed package without sys.path tricks. The test
suite regenerates them into a temporary folder and fails if they drift.
"""
import pathlib
import sys

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
PACKAGE_PREFIX = "services/wire"  # where proto/ is mounted in the Python tree


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Writes the stubs for every .proto file under out_dir; returns their paths."""
    protos = sorted(PROTO_DIR.rglob("*.proto"))
    include = f"-I{PACKAGE_PREFIX}={PROTO_DIR}"
    grpc_include = f"-I{pathlib.Path(protoc.__file__).parent / '_proto'}"
    virtual = [f"{PACKAGE_PREFIX}/{p.relative_to(PROTO_DIR)}" for p in protos]
    code = protoc.main(["protoc", include, grpc_include, f"--python_out={out_dir}",
                        f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *virtual])
    if code != 0:
        raise SystemExit(f"protoc failed with exit code {code}")
    return sorted((out_dir / PACKAGE_PREFIX).rglob("*.py*"))


if __name__ == "__main__":
    out = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    for path in generate(out):
        print(path)
