"""Regenerate the committed gRPC stubs from proto/ (run after editing a .proto).

    python scripts/gen_proto.py [OUT_DIR]

The stubs land in services/contract/wire/, whose import path is diloco.services.contract.wire (the
package-dir mapping of pyproject.toml), as diloco.services.contract.wire.diloco.v1, so they
import from an installed package without sys.path tricks. The test suite
regenerates them into a temporary folder and fails if they drift.
"""
import pathlib
import shutil
import sys
import tempfile

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
PACKAGE_PREFIX = "diloco/services/contract/wire"  # where proto/ is mounted in the Python import tree
FOLDER = "services/contract/wire"  # where that package is in the repository


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Writes the stubs for every .proto file under out_dir/services/contract/wire; returns their paths."""
    protos = sorted(PROTO_DIR.rglob("*.proto"))
    include = f"-I{PACKAGE_PREFIX}={PROTO_DIR}"
    grpc_include = f"-I{pathlib.Path(protoc.__file__).parent / '_proto'}"
    virtual = [f"{PACKAGE_PREFIX}/{p.relative_to(PROTO_DIR)}" for p in protos]
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        code = protoc.main(["protoc", include, grpc_include, f"--python_out={tmp}",
                            f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", *virtual])
        if code != 0:
            raise SystemExit(f"protoc failed with exit code {code}")
        generated = pathlib.Path(tmp) / PACKAGE_PREFIX
        for path in sorted(generated.rglob("*.py*")):
            target = out_dir / FOLDER / path.relative_to(generated)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
            written.append(target)
    return written


if __name__ == "__main__":
    out = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    for path in generate(out):
        print(path)
