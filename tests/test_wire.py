"""The committed gRPC stubs import from the installed package and match proto/."""
import filecmp
import importlib.util
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_match_the_proto_files(tmp_path):
    generated = _load_generator().generate(tmp_path)
    assert generated
    for path in generated:
        committed = ROOT / path.relative_to(tmp_path)
        assert committed.exists(), f"{committed} is missing: run scripts/gen_proto.py"
        assert filecmp.cmp(path, committed, shallow=False), (
            f"{committed.relative_to(ROOT)} drifted from proto/: run scripts/gen_proto.py")


def test_stubs_import_without_path_tricks(tmp_path):
    # From an unrelated working directory, with nothing added to sys.path.
    code = ("from diloco.services.contract.wire import pb, pb_grpc; "
            "print(pb.DESCRIPTOR.package, sorted(pb.DESCRIPTOR.services_by_name['Syncer'].methods_by_name))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == ("diloco.v1 ['Attend', 'Heartbeat', 'Join', 'Leave', 'PullFragment', "
                           "'PushFragment', 'Status']")
