"""Loading a torch.distributed.checkpoint (DCP) directory without running code from it.

DCP's own reader unpickles ``.metadata`` with plain ``pickle.load`` and the non-tensor
entries (the optimizer's hyperparameters) with ``torch.load(weights_only=False)``, so a
checkpoint planted in a shared ``output.dir`` could run code on resume. Here the
metadata goes through an unpickler that builds only DCP's own metadata classes and the
few torch/stdlib values they hold (``torch.Size``, dtypes, layouts, paths), and the
non-tensor entries through ``torch.load(weights_only=True)``. Anything else is refused
with ``CheckpointError`` before it is built.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import default_planner as _dp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from specforge_opd.errors import UserError

#: (module, name) pairs the metadata may name; plus every ``torch.<dtype>`` (checked by type).
_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.planner", "LoadItemType"),
    ("torch.distributed.checkpoint.planner", "WriteItemType"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"), ("builtins", "complex"),
}


class UnsafeCheckpointError(UserError, ValueError):
    """A checkpoint's metadata names a class that a DCP checkpoint never holds; nothing of it was run."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, f, where: Path):
        super().__init__(f)
        self.where = where

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"{self.where}: names {module}.{name}, which no checkpoint of this trainer holds; refused without "
            f"running it (the file may have been planted): delete this checkpoint directory, or use a fresh output.dir")


def load_metadata(path: str | Path) -> Metadata:
    """Unpickle a DCP ``.metadata`` file with the allowlist of this module.

    Raises:
        UnsafeCheckpointError: the file names any other class or function.
            Also when the file is unreadable or holds something other than DCP ``Metadata``.
    """
    path = Path(path)
    with open(path, "rb") as f:
        try:
            meta = _MetadataUnpickler(f, path).load()
        except UnsafeCheckpointError:
            raise
        except Exception as e:  # truncated or not a pickle at all
            raise UnsafeCheckpointError(f"{path}: unreadable checkpoint metadata ({type(e).__name__}: {e}); "
                                        f"delete this checkpoint directory to resume from the one before") from e
    if not isinstance(meta, Metadata):
        raise UnsafeCheckpointError(f"{path}: holds a {type(meta).__name__}, not DCP checkpoint metadata; "
                                    f"delete this checkpoint directory, or use a fresh output.dir")
    return meta


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` uses ``load_metadata`` (no arbitrary unpickling)."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        meta = load_metadata(Path(self.path) / name)
        if getattr(meta, "storage_meta", None) is None:
            meta.storage_meta = StorageMeta()
        meta.storage_meta.load_id = getattr(self, "load_id", None)
        return meta


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that reads non-tensor entries with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item, value) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpointError(f"checkpoint entry {read_item.dest_index.fqn}: refused a non-weights object "
                                        f"without running it ({str(e).splitlines()[0][:160]}); delete this "
                                        f"checkpoint directory, or use a fresh output.dir") from None
        if self.flatten_state_dict:
            # the same helper DefaultLoadPlanner.load_bytes uses
            _dp.set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
