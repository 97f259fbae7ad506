"""A local Hugging Face checkpoint, as users download it: read, checked, and partly loaded.

``Checkpoint.open`` validates a directory before any server starts: ``config.json`` parses and
names a ``model_type``; the weights are safetensors, one file or shards listed by
``model.safetensors.index.json``; every shard exists and its header describes tensors that fit
in the file (a truncated download fails here, naming the file). Only headers are read.

The encoder export needs the vision tower alone: ``load`` reads just the tensors under a
family's prefixes, from whichever shards hold them, as float32 — a 7B model's language weights
are never touched. ``fingerprint`` identifies config, processor settings and every weight
file's content for the export cache; content hashes are memoised by (path, size, mtime) so a
restart does not re-read gigabytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
"""Where transformers writes image processor settings (older layout first)."""
_HEADER_LIMIT = 100 << 20
"""safetensors refuses headers above 100 MB; so do we (a corrupt length must not allocate)."""


class CheckpointError(ValueError):
    """The directory is not a usable checkpoint; the message names the file and the fix."""


@dataclass(frozen=True)
class Checkpoint:
    """A validated checkpoint directory."""

    path: Path
    config: dict[str, Any]
    """``config.json``, parsed."""
    weight_files: tuple[Path, ...]
    """Every safetensors file, sorted."""
    tensor_files: dict[str, Path] = field(repr=False)
    """Tensor name -> the file holding it (from the index, or the single file's header)."""

    @property
    def model_type(self) -> str:
        return str(self.config["model_type"])

    @property
    def text_config(self) -> dict[str, Any]:
        """The language model's settings: ``text_config``, or the top level in older
        (flat) configs such as the original Qwen2-VL / Qwen2.5-VL downloads."""
        return self.config.get("text_config") or self.config

    @classmethod
    def open(cls, path: str | Path) -> Checkpoint:
        """Validate ``path``; raise :class:`CheckpointError` naming what is wrong."""
        path = Path(path).expanduser()
        if not path.is_dir():
            raise CheckpointError(f"{path}: no such directory (expected a Hugging Face checkpoint)")
        config_file = path / CONFIG
        if not config_file.is_file():
            raise CheckpointError(
                f"{path} is not a checkpoint: it has no {CONFIG} (point --model at the folder a "
                "Hugging Face download created, the one holding config.json and *.safetensors)"
            )
        try:
            config = json.loads(config_file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{config_file}: not valid JSON: {exc}") from None
        if not isinstance(config, dict) or not config.get("model_type"):
            raise CheckpointError(f"{config_file}: no 'model_type'")
        tensor_files = _tensor_files(path)
        return cls(
            path=path,
            config=config,
            weight_files=tuple(sorted(set(tensor_files.values()))),
            tensor_files=tensor_files,
        )

    def processor_settings(self) -> dict[str, Any]:
        """The image processor's saved settings (``preprocessor_config.json``, or the
        ``image_processor`` section of ``processor_config.json``)."""
        for name in PROCESSOR_FILES:
            file = self.path / name
            if not file.is_file():
                continue
            try:
                raw = json.loads(file.read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise CheckpointError(f"{file}: not valid JSON: {exc}") from None
            settings = raw.get("image_processor", raw) if name == "processor_config.json" else raw
            if isinstance(settings, dict):
                return settings
        raise CheckpointError(
            f"{self.path}: no image processor settings ({' or '.join(PROCESSOR_FILES)})"
        )

    def load(
        self,
        prefixes: dict[str, str],
        progress: Callable[[Iterable[Path]], Iterable[Path]] = iter,
    ):
        """Tensors whose names start with one of ``prefixes``, renamed by it, as float32.

        ``prefixes`` maps a checkpoint prefix to the module prefix it loads into (the longest
        matching prefix wins), e.g. ``{"model.visual.": "", "visual.": ""}`` takes a Qwen
        tower from either layout. Only shards holding such tensors are opened.
        """
        import torch
        from safetensors import safe_open

        ordered = sorted(prefixes, key=len, reverse=True)
        wanted: dict[Path, list[tuple[str, str]]] = {}
        for name, file in self.tensor_files.items():
            for prefix in ordered:
                if name.startswith(prefix):
                    wanted.setdefault(file, []).append(
                        (name, prefixes[prefix] + name[len(prefix) :])
                    )
                    break
        if not wanted:
            raise CheckpointError(
                f"{self.path}: no tensors under {sorted(prefixes)}; is this checkpoint of the "
                f"model type its config says ({self.model_type!r})?"
            )
        tensors: dict[str, torch.Tensor] = {}
        for file in progress(sorted(wanted)):
            try:
                with safe_open(str(file), framework="pt") as shard:
                    for name, target in wanted[file]:
                        tensors[target] = shard.get_tensor(name).to(torch.float32)
            except (OSError, RuntimeError, ValueError) as exc:
                raise CheckpointError(f"{file}: cannot read its tensors: {exc}") from None
        return tensors

    def fingerprint(self, memo: Path | None = None) -> str:
        """Hash of config, processor settings, chat template, tokenizer and every weight file.

        ``memo`` (a JSON file) remembers each weight file's content hash by path, size and
        mtime, so only new or changed files are read again.
        """
        known = _read_memo(memo)
        h = hashlib.sha256(b"epd-checkpoint-v1\0")
        for name in (CONFIG, *PROCESSOR_FILES, "chat_template.jinja", "tokenizer_config.json"):
            file = self.path / name
            if file.is_file():
                h.update(f"{name}\0".encode() + file.read_bytes() + b"\0")
        for file in self.weight_files:
            stat = file.stat()
            key = f"{file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
            if key not in known:
                known[key] = _file_sha256(file)
            h.update(f"{file.name}\0{stat.st_size}\0{known[key]}\0".encode())
        if memo is not None:
            memo.parent.mkdir(parents=True, exist_ok=True)
            tmp = memo.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(known, indent=1, sort_keys=True))
            tmp.replace(memo)
        return h.hexdigest()


def _tensor_files(path: Path) -> dict[str, Path]:
    """Tensor name -> file, after checking every weight file named by the index exists and
    is a well-formed safetensors file whose tensors fit in it."""
    index = path / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: not a safetensors index ({exc})") from None
        files = {name: path / str(file) for name, file in weight_map.items()}
        missing = sorted({f.name for f in files.values() if not f.is_file()})
        if missing:
            raise CheckpointError(
                f"{path}: shard(s) {', '.join(missing)} named in {INDEX} are missing "
                "(an incomplete download? fetch the checkpoint again)"
            )
        for file in sorted(set(files.values())):
            names = set(safetensors_header(file))
            absent = sorted(n for n, f in files.items() if f == file and n not in names)
            if absent:
                raise CheckpointError(
                    f"{file}: lacks {len(absent)} tensor(s) that {INDEX} places there, "
                    f"e.g. {absent[0]!r}"
                )
        return files
    single = path / SINGLE
    if single.is_file():
        return {name: single for name in safetensors_header(single)}
    others = sorted(p.name for p in path.glob("*.bin")) + sorted(
        p.name for p in path.glob("*.safetensors")
    )
    hint = f" (found {', '.join(others[:3])}: only safetensors are loaded)" if others else ""
    raise CheckpointError(f"{path}: no {SINGLE} and no {INDEX}{hint}")


def safetensors_header(file: Path) -> dict[str, Any]:
    """The tensor entries of a safetensors file's header, checked against the file's size."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) != 8:
                raise CheckpointError(f"{file}: truncated ({size} bytes): not a safetensors file")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > min(_HEADER_LIMIT, size - 8):
                raise CheckpointError(f"{file}: corrupt safetensors header (length {header_len})")
            header = json.loads(f.read(header_len))
    except OSError as exc:
        raise CheckpointError(f"{file}: cannot read: {exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{file}: corrupt safetensors header: {exc}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: corrupt safetensors header")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    data_bytes = size - 8 - header_len
    for name, entry in tensors.items():
        try:
            end = int(entry["data_offsets"][1])
        except (KeyError, IndexError, TypeError, ValueError):
            raise CheckpointError(f"{file}: corrupt safetensors entry for {name!r}") from None
        if end > data_bytes:
            raise CheckpointError(
                f"{file}: truncated: tensor {name!r} ends at byte {end} of a {data_bytes}-byte "
                "data section (an interrupted download? fetch this shard again)"
            )
    return tensors


def _file_sha256(file: Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


def _read_memo(memo: Path | None) -> dict[str, str]:
    if memo is None or not memo.is_file():
        return {}
    try:
        data = json.loads(memo.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}  # a damaged memo only costs re-hashing
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}
