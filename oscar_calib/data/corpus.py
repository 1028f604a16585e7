"""Calibration text: the embedded corpora, local files, or a `datasets` hub id.

Two corpora ship with every Python (no network, the same text for the same Python version):

* ``embedded`` (the default): CPython's own documentation topics (``pydoc_data.topics``, ~110K
  tokens of English reference prose), topics joined in key order.
* ``embedded-code``: the source code of six pure-Python standard-library modules
  (:data:`CODE_MODULES`, ~78K tokens of Python with its docstrings and comments), a second domain
  to measure on (docs/design/numerics.md); never the calibration default.

Each one's token stream is split in two halves: ``calibration`` (first half, what
``oscar calibrate`` reads) and ``heldout`` (second half, what ``oscar verify`` and ``oscar eval``
read), so the two never overlap.

Documents are joined with the tokenizer's EOS token and the stream is cut into sequences of
``seq_len`` tokens (the last one may be shorter); no padding is ever used.
"""

from __future__ import annotations

import hashlib
import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import DataError, InputError, OscarWarning, first_line

EMBEDDED = "embedded"
EMBEDDED_CODE = "embedded-code"
CODE_MODULES = ("argparse", "calendar", "difflib", "fractions", "statistics", "textwrap")
SPLITS = ("calibration", "heldout")
TEXT_SUFFIXES = (".txt", ".md", ".jsonl", ".json", ".parquet")
MAX_NON_TEXT = 0.01       # share of undecodable bytes and control characters above which a file is not text
_CONTROL = re.compile("[\x00-\x08\x0e-\x1f\x7f]")


def _checked_text(path: Path) -> str:
    """A text file's content, refusing one that is not text (binary, another encoding): more than
    1% of its characters undecodable as UTF-8 or control characters. A few bad bytes are replaced
    with a warning."""
    raw = path.read_bytes()
    text = raw.decode("utf-8", errors="replace")
    bad = text.count("\ufffd")
    ctrl = len(_CONTROL.findall(text))
    if text and (bad + ctrl) / len(text) > MAX_NON_TEXT:
        raise DataError(f"{path}: does not look like text: {(bad + ctrl) / len(text):.0%} of its {len(text)} characters "
                        "are not valid UTF-8 or are control characters (a binary file, or another encoding?)")
    if bad:
        warnings.warn(f"{path}: {bad} byte sequence(s) are not valid UTF-8 and were replaced", OscarWarning,
                      stacklevel=3)
    return text


def embedded_texts() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def embedded_code_texts() -> list[str]:
    """The source of :data:`CODE_MODULES`, one document per module, in that order."""
    import importlib.util

    out = []
    for name in CODE_MODULES:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            raise DataError(f"{EMBEDDED_CODE}: this Python has no source for the standard-library module {name!r}")
        out.append(Path(spec.origin).read_text(encoding="utf-8"))
    return out


# name -> (documents, description)
EMBEDDED_SOURCES = {
    EMBEDDED: (embedded_texts, "embedded:pydoc_data.topics"),
    EMBEDDED_CODE: (embedded_code_texts, f"embedded-code:stdlib[{','.join(CODE_MODULES)}]"),
}


def _read_file(path: Path, text_field: str) -> list[str]:
    suffix = path.suffix.lower()
    try:
        if suffix in (".txt", ".md"):
            return [_checked_text(path)]
        if suffix in (".jsonl", ".json"):
            out = []
            for n, line in enumerate(_checked_text(path).splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except ValueError:
                    raise DataError(f"{path}:{n}: not valid JSON") from None
                if not isinstance(rec, dict) or text_field not in rec:
                    raise DataError(f"{path}:{n}: no {text_field!r} field (choose one with --text-field)")
                out.append(str(rec[text_field]))
            return out
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            try:
                table = pq.read_table(path)
            except (OSError, ValueError) as e:          # pyarrow's ArrowInvalid is a ValueError
                raise DataError(f"{path}: not a readable parquet file ({first_line(e)})") from None
            if text_field not in table.column_names:
                raise DataError(f"{path}: no column {text_field!r} (columns: {', '.join(table.column_names)})")
            return [str(x) for x in table.column(text_field).to_pylist()]
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from None
    raise InputError(f"{path}: unsupported data file type {suffix!r} (use {', '.join(TEXT_SUFFIXES)})")


_EXTENSION = re.compile(r"\.[A-Za-z][A-Za-z0-9]{0,7}")


def looks_like_path(data: str) -> bool:
    """Whether a ``--data`` value is meant as a local file or directory rather than a datasets hub
    id: it starts with ``.``, ``/`` or ``~``, has a backslash or more than one ``/``, its folder
    exists here, or it ends in a file extension (letters first: ``corpus.tx``, not the version in
    ``org/name-v1.2``)."""
    if data.startswith((".", "/", "~")) or "\\" in data or data.count("/") > 1:
        return True
    path = Path(data)
    if "/" in data and path.parent.is_dir():
        return True
    return bool(_EXTENSION.fullmatch(path.suffix))


def check_data_path(data: str) -> None:
    """One line, before anything is loaded, when ``data`` names a local file or directory that is
    not there: ``no such file: corpus.tx``. Embedded names and hub ids pass."""
    if data in EMBEDDED_SOURCES or not looks_like_path(data):
        return
    path = Path(data).expanduser()
    if not path.exists():
        raise DataError(f"no such file: {data} (--data takes {EMBEDDED}, {EMBEDDED_CODE}, a "
                        f"{'/'.join(TEXT_SUFFIXES)} file, a directory of them, or a datasets hub id)")


def load_texts(data: str, *, split: str = "train", text_field: str = "text") -> tuple[list[str], str]:
    """Documents and a short description of where they came from: the checks that need no
    tokenizer (the file exists, is readable and is text), so a caller can run them before it
    loads a model."""
    if data in EMBEDDED_SOURCES:
        texts, source = EMBEDDED_SOURCES[data]
        return texts(), source
    check_data_path(data)
    path = Path(data).expanduser()
    if path.is_file():
        return _read_file(path, text_field), f"file:{path.name}"
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
        if not files:
            raise DataError(f"{data}: directory has no {'/'.join(TEXT_SUFFIXES)} files")
        texts = []
        for f in files:
            texts.extend(_read_file(f, text_field))
        return texts, f"dir:{path.name}"
    try:
        import datasets

        ds = datasets.load_dataset(data, split=split)
    except Exception as e:  # noqa: BLE001 - datasets raises many types; all mean "could not load"
        raise DataError(f"cannot load dataset {data!r} (split {split!r}) from the hub: {first_line(e)}") from None
    if text_field not in ds.column_names:
        raise DataError(f"dataset {data!r} has no column {text_field!r} (columns: {', '.join(ds.column_names)})")
    return [str(x) for x in ds[text_field]], f"hub:{data}:{split}"


def token_stream(texts: list[str], tokenizer) -> torch.Tensor:
    """All documents tokenised and joined with EOS (1-D int64)."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for t in texts:
        if not t.strip():
            continue
        ids.extend(tokenizer(t, add_special_tokens=False)["input_ids"])
        if eos is not None:
            ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


@dataclass
class TokenPlan:
    """The exact token ids a run uses: calibration sequences and held-out sequences."""

    calibration: list[torch.Tensor]
    heldout: list[torch.Tensor]
    source: str

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.calibration)

    def sha256(self) -> str:
        h = hashlib.sha256()
        for s in self.calibration + self.heldout:
            h.update(s.numpy().astype("<i8").tobytes())
            h.update(b"|")
        return h.hexdigest()

    def batches(self, batch_size: int) -> list[torch.Tensor]:
        """Equal-length sequences stacked ``batch_size`` at a time (a shorter tail alone)."""
        out, cur = [], []
        for s in self.calibration:
            if cur and (len(cur) == batch_size or len(s) != len(cur[0])):
                out.append(torch.stack(cur))
                cur = []
            cur.append(s)
        if cur:
            out.append(torch.stack(cur))
        return out


def token_windows(tokenizer, seq_len: int, *, data: str = EMBEDDED, split: str = "train", text_field: str = "text",
                  corpus_split: str = "calibration", documents: tuple[list[str], str] | None = None
                  ) -> tuple[list[torch.Tensor], torch.Tensor, str]:
    """``data``'s token stream (an embedded corpus: its ``corpus_split`` half) cut into consecutive
    windows of ``seq_len`` tokens, a ragged tail dropped (kept when it is the only window): the
    windows, the stream and a description of the source."""
    texts, source = documents if documents is not None else load_texts(data, split=split, text_field=text_field)
    stream = token_stream(texts, tokenizer)
    if data in EMBEDDED_SOURCES:
        half = len(stream) // 2
        stream = stream[:half] if corpus_split == "calibration" else stream[half:]
        source += f"[{corpus_split}]"
    if len(stream) == 0:
        raise DataError(f"no text in {source}")
    windows = [stream[i:i + seq_len] for i in range(0, len(stream), seq_len)]
    if len(windows) > 1 and len(windows[-1]) < seq_len:
        windows.pop()                       # a ragged tail window is dropped
    return windows, stream, source


def pick_windows(count: int, windows: int, seed: int) -> list[int]:
    """Which ``count`` of ``windows`` windows a run holds out: the first of a ``seed``-driven
    permutation (the rest of it is what :func:`plan_tokens` calibrates on)."""
    return torch.randperm(windows, generator=torch.Generator().manual_seed(seed)).tolist()[:count]


def plan_tokens(tokenizer, *, data: str = EMBEDDED, split: str = "train", text_field: str = "text",
                tokens: int, seq_len: int, heldout_tokens: int, heldout_seqs: int = 1,
                seed: int = 0, corpus_split: str = "calibration",
                documents: tuple[list[str], str] | None = None) -> TokenPlan:
    """Choose calibration and held-out sequences.

    The stream is cut into ``seq_len`` windows; a ``seed``-driven permutation picks which windows
    calibrate (enough for ``tokens``) and which ``heldout_seqs`` windows are held out (their first
    ``heldout_tokens`` tokens). For an embedded corpus, ``corpus_split`` picks its half.
    ``documents``: what :func:`load_texts` returned for ``data`` already (read before the model
    was loaded, so a bad file is reported first); read here otherwise.
    """
    if tokens <= 0:
        raise InputError(f"--tokens must be positive, got {tokens}")
    if seq_len < 16:
        raise InputError(f"--seq-len must be at least 16, got {seq_len}")
    windows, stream, source = token_windows(tokenizer, seq_len, data=data, split=split, text_field=text_field,
                                            corpus_split=corpus_split, documents=documents)
    need_cal = -(-tokens // seq_len)
    if len(windows) < need_cal + heldout_seqs:
        raise DataError(
            f"{source} has {len(stream)} tokens; {tokens} calibration tokens in sequences of {seq_len} plus "
            f"{heldout_seqs} held-out sequence(s) need {(need_cal + heldout_seqs) * seq_len} "
            "(lower --tokens or --seq-len, or give more data)"
        )
    if heldout_tokens > seq_len:
        warnings.warn(f"--heldout-tokens {heldout_tokens} is more than one sequence: the held-out prefix is capped at "
                      f"--seq-len {seq_len} tokens (raise --seq-len for more)", OscarWarning, stacklevel=2)
    order = pick_windows(len(windows), len(windows), seed)
    held = [windows[i][:heldout_tokens] for i in order[:heldout_seqs]]
    cal_idx = sorted(order[heldout_seqs:heldout_seqs + need_cal])
    cal = [windows[i] for i in cal_idx]
    extra = need_cal * seq_len - tokens
    if extra:
        cal[-1] = cal[-1][: seq_len - extra]
    if len(cal[-1]) < 2:
        cal.pop()
    return TokenPlan(calibration=cal, heldout=held, source=source)


def same_embedded_text(calibration: dict, tokenizer) -> bool | None:
    """Whether this interpreter's embedded corpus, cut as an artifact's calibration record says
    (``tokens``, ``seq_len``, ``seed``, ``heldout_tokens``), gives the token ids that artifact was
    calibrated on (its ``token_sha256``). False: another text (the embedded corpora are the
    interpreter's own ``pydoc_data`` and standard library, which differ between Python versions) or
    another tokenizer. None: the record does not say (not an embedded corpus, or no digest). The
    held-out sequences are not recorded apart; 1, 2, 4 and 8 are tried."""
    data, want = str(calibration.get("data", "")), calibration.get("token_sha256")
    name = next((n for n, (_, label) in EMBEDDED_SOURCES.items() if data.startswith(label + "[")), None)
    try:
        tokens, seq_len, seed, held = (int(calibration[k]) for k in ("tokens", "seq_len", "seed", "heldout_tokens"))
    except (KeyError, TypeError, ValueError):
        return None
    if name is None or not want:
        return None
    documents = load_texts(name)
    for seqs in (1, 2, 4, 8):
        if held % seqs:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", OscarWarning)
                plan = plan_tokens(tokenizer, data=name, tokens=tokens, seq_len=seq_len, heldout_tokens=held // seqs,
                                   heldout_seqs=seqs, seed=seed, documents=documents)
        except (DataError, InputError):
            continue
        if plan.sha256() == want:
            return True
    return False
