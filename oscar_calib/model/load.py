"""Model loading: the one way every tool gets a model (:func:`load_model` -> :class:`LoadedModel`),
its tokenizer and the checks before any weight is read; GGUF models de-quantised once and cached
as safetensors. Which model a MODEL argument names is :mod:`.source`.
"""

from __future__ import annotations

import contextlib
import dataclasses
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
from .geometry import Geometry, geometry_of, model_fingerprint, text_config_source
from .placement import Placement
from .registry import model_class
from .source import DEFAULT_MODEL, ModelSource, resolve_model

DTYPES = ("auto", "float32", "bfloat16", "float16")


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
    def wrap(cls, model, tokenizer, source: ModelSource, config=None) -> "LoadedModel":
        """Wrap a model loaded elsewhere (e.g. a random-init model in a test or benchmark).
        ``config``: the checkpoint's own config, when transformers built the model from its text
        config alone (a Llama 4 checkpoint loads as ``Llama4ForCausalLM``): the geometry then names
        the config the text config came from."""
        geo = geometry_of(model)
        if geo.text_config is None and config is not None and text_config_source(config):
            geo = dataclasses.replace(geo, text_config=text_config_source(config))
        return cls(model, tokenizer, source, geo, model_fingerprint(model))


def load_model(spec: str = DEFAULT_MODEL, *, dtype: str = "auto", device: str = "cpu",
               trust_remote_code: bool = False, placement: Placement | None = None,
               progress: ProgressFn | None = None, tokenizer=None) -> LoadedModel:
    """Load a model, its tokenizer, geometry and fingerprint. The model is in eval mode; GGUF
    weights are de-quantised by transformers (float32 unless ``dtype`` says otherwise).
    ``placement`` spreads it with accelerate (``device_map``, ``max_memory``, ``offload_dir``);
    without one it goes to ``device``. ``progress`` hears one stage, ``loading model`` (its
    label says so when a GGUF model is de-quantised: the first load only). ``tokenizer``: one
    :func:`load_tokenizer` gave already (a caller that checks its data before the weights load).
    The one way every tool loads a model."""
    source = resolve_model(spec)
    cached = gguf_cache_dir(source) if source.gguf_file else None
    fresh_gguf = bool(source.gguf_file) and not (cached is not None and (cached / "config.json").exists())
    with step(progress, "loading model (de-quantising GGUF, first time only)" if fresh_gguf else "loading model"):
        return _load_model(spec, source, dtype, device, trust_remote_code, placement or Placement(), tokenizer)


def load_tokenizer(spec: str = DEFAULT_MODEL, *, trust_remote_code: bool = False,
                   progress: ProgressFn | None = None):
    """MODEL's tokenizer alone, after the architecture check on its config (no weights are read):
    what a caller needs to check its data before :func:`load_model` (pass the tokenizer on).
    ``progress`` hears one stage, ``loading tokenizer``."""
    source = resolve_model(spec)
    with step(progress, "loading tokenizer"):
        load_path, kwargs = _from_pretrained_args(source, trust_remote_code)
        if "gguf_file" not in kwargs:
            _precheck_config(spec, source, load_path, kwargs)
        try:
            with quiet_loading():
                tok = _auto_tokenizer(load_path, kwargs)
        except Exception as e:  # noqa: BLE001 - as in _load_model: every failure means "cannot load"
            raise _load_error(spec, source, e) from None
        check_tokenizer(spec, tok, cached=load_path if load_path != source.path else None)
        return _pad_token(tok)


def _auto_tokenizer(load_path: str, kwargs: dict):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(load_path, **kwargs)


def _from_pretrained_args(source: ModelSource, trust_remote_code: bool) -> tuple[str, dict]:
    """Where ``from_pretrained`` reads ``source`` (the de-quantised copy of a GGUF model once it
    exists) and its keyword arguments."""
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
    return load_path, kwargs


def _load_error(spec: str, source: ModelSource, e: Exception) -> ModelLoadError:
    first = first_line(e)
    if source.kind == "hub":
        return ModelLoadError(f"cannot load {spec!r} from the Hugging Face hub (no network or not cached?): {first}")
    if "trust_remote_code" in str(e):
        return ModelLoadError(f"{spec}: needs custom code; rerun with --trust-remote-code if you trust it")
    return ModelLoadError(f"cannot load model {spec!r}: {first}")


def _pad_token(tok):
    if tok.pad_token_id is None and tok.eos_token_id is not None:
        tok.pad_token = tok.eos_token
    return tok


def _load_model(spec: str, source: ModelSource, dtype: str, device: str, trust_remote_code: bool,
                placement: Placement, tokenizer=None) -> LoadedModel:
    device_map, max_memory, offload_folder = placement.device_map, placement.max_memory, placement.offload_dir
    torch_dtype = _torch_dtype(dtype)
    load_path, kwargs = _from_pretrained_args(source, trust_remote_code)
    if "gguf_file" not in kwargs and tokenizer is None:       # load_tokenizer checked the config already
        _precheck_config(spec, source, load_path, kwargs)
    if source.kind == "local":
        check_weight_files(spec, Path(load_path))
    try:
        with quiet_loading():
            tok = tokenizer if tokenizer is not None else _auto_tokenizer(load_path, kwargs)
    except Exception as e:  # noqa: BLE001 - as for the weights below
        raise _load_error(spec, source, e) from None
    if tokenizer is None:                                  # load_tokenizer checked a tokenizer it gave
        check_tokenizer(spec, tok, cached=load_path if load_path != source.path else None)
    try:
        with quiet_loading():
            config = None if "gguf_file" in kwargs else _config_for(load_path, kwargs)
            model = model_class(config).from_pretrained(
                load_path, dtype=torch_dtype, device_map=device_map, max_memory=max_memory,
                **({"offload_folder": str(offload_folder)} if offload_folder is not None else {}), **kwargs
            )
            if "gguf_file" in kwargs and gguf_cache_dir(source) is not None:
                _save_gguf_cache(model, tok, gguf_cache_dir(source))
    except Exception as e:  # noqa: BLE001 - transformers, safetensors, gguf and torch raise many types; all mean "cannot load"
        raise _load_error(spec, source, e) from None
    if device_map is None:
        model.to(resolve_device(device))
    model.eval()
    model.requires_grad_(False)
    return LoadedModel.wrap(model, _pad_token(tok), source, config)


def _config_for(load_path: str, kwargs: dict):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(load_path, **kwargs)


PROBE_SENTENCE = "The quick brown fox jumps over the lazy dog while the band plays on."


def check_tokenizer(spec: str, tok, cached: str | None = None) -> None:
    """Refuse a BPE tokenizer with a vocabulary of words (over 1,024 entries) that cuts ordinary
    English into single characters: a BPE built without its merges, which some transformers
    versions make when they convert a GGUF file's SentencePiece vocabulary (transformers 5.17 with
    tokenizers 0.23.2 does for Gemma-3's GGUF: one token per character, the model's perplexity in
    the thousands). Every tool would otherwise measure a model that reads text it was never trained
    on. ``cached``: the de-quantised copy the tokenizer came from (named in the message, to
    delete)."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None or type(backend.model).__name__ != "BPE" or len(tok) <= 1024:
        return                       # a byte- or character-level vocabulary is meant to cut so
    n = len(tok(PROBE_SENTENCE, add_special_tokens=False)["input_ids"])
    words = len(PROBE_SENTENCE.split())
    if n < 2 * words:
        return
    import transformers

    where = f"; delete its cached copy {cached} and load again" if cached else ""
    raise ModelLoadError(
        f"{spec}: its tokenizer cuts text into single characters ({n} tokens for a {words}-word sentence), a BPE "
        f"without merges (seen with transformers 5.17 converting Gemma-3's GGUF file; this is transformers "
        f"{transformers.__version__}); upgrade transformers or load the model's Hugging Face checkpoint{where}")


def check_weight_files(spec: str, directory: Path) -> None:
    """Refuse a checkpoint whose safetensors files do not hold every byte their headers promise
    (a half-finished download or copy), naming the file, before transformers reads any weights."""
    from ..contract.stfile import read_header
    from ..errors import OscarError

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
    """Best effort: a failure to cache never fails a load; the first of two racing writers wins. Only
    a float32 model is cached (the copy is what ``dtype="auto"`` loads later: a first load in
    bfloat16 must not make every later one bfloat16)."""
    import torch

    if any(p.dtype != torch.float32 for p in model.parameters()):
        return
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
