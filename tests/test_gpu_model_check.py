"""benchmarks/gpu_model_check.py carries the bundled model to a GPU machine in two calls: each half fits a call
beside the tree, the halves reassemble bit for bit, and a missing or damaged half stops the check with a clear
error instead of comparing another file."""
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_model_check  # noqa: E402

CALL_LIMIT = 64 << 20   # what one call to the GPU machine carries, the working tree included


def folder_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())


@pytest.fixture(scope="module")
def carried(tmp_path_factory):
    out = tmp_path_factory.mktemp("carry")
    return out, gpu_model_check.split_model(out)


def test_each_half_fits_a_call_and_they_reassemble_the_bundled_model(carried, tmp_path, gguf_path):
    out, (call1, call2) = carried
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    tree = sum((ROOT / p).stat().st_size for p in tracked.decode().split("\0") if p and (ROOT / p).is_file())
    for call in (call1, call2):
        assert tree + folder_bytes(call) + (1 << 20) < CALL_LIMIT   # room for gguf's wheel in call 1
    path = gpu_model_check.assemble(out, tmp_path)
    assert path.read_bytes() == Path(gguf_path).read_bytes()
    assert (call1 / "tokenizer" / "tokenizer.json").exists()


def test_a_missing_or_damaged_half_is_a_clear_error(carried, tmp_path):
    out, (call1, call2) = carried
    part2 = call2 / "model.part2"
    data = part2.read_bytes()
    try:
        part2.unlink()
        with pytest.raises(SystemExit, match="missing .*model.part2.*same warm machine"):
            gpu_model_check.assemble(out, tmp_path)
        part2.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
        with pytest.raises(SystemExit, match="does not match its sha256"):
            gpu_model_check.assemble(out, tmp_path)
    finally:
        part2.write_bytes(data)
    assert hashlib.sha256(gpu_model_check.assemble(out, tmp_path).read_bytes()).hexdigest() == \
        json.loads((call1 / "model.json").read_text())["sha256"]
