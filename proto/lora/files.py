"""An adapter's files on disk: where a runtime load may read them from
(--lora-root), and reading each file once, bounded, into memory, so that the
bytes checked are the bytes served and a later change on disk touches
nothing already loaded.

A failure says what went wrong only in the server's log: a client sees the
same message whether the path is missing, unreadable, not an adapter, or
outside the root, so that loads cannot map the worker's filesystem.

No torch: the router imports the root check."""

from __future__ import annotations

import hashlib
import os
import stat

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20


def public_message(name: str) -> str:
    """What a client hears of any missing, unreadable or forbidden adapter path."""
    return (
        f"LoRA adapter {name!r} cannot be loaded from this lora_path: it is missing, unreadable, "
        "not a peft LoRA adapter, or outside --lora-root (the server log says which)"
    )


class AdapterFilesError(ValueError):
    """An adapter's files cannot be had. str(): the detail, for the log;
    `public`: the message a client gets (public_message)."""

    def __init__(self, name: str, detail: str):
        super().__init__(f"LoRA adapter {name!r}: {detail}")
        self.public = public_message(name)


class AdapterPathForbidden(AdapterFilesError):
    """The path resolves outside --lora-root (403)."""


def under_root(path: str, root: str | None) -> str:
    """The path a runtime load reads: a relative lora_path is taken under the root (if one is set)."""
    return os.path.join(root, path) if root else path


def within_root(path: str, root: str | None) -> bool:
    """Whether path, with symlinks and `..` resolved (os.path.realpath), lies
    inside root's real path; always True without a root (False for a path
    with a NUL, which names no file)."""
    if "\0" in path:
        return False
    if not root:
        return True
    real, top = os.path.realpath(path), os.path.realpath(root)
    return real == top or real.startswith(top.rstrip(os.sep) + os.sep)


def read_file(name: str, path: str, root: str | None, limit: int) -> bytes:
    """A regular file's bytes, at most `limit` of them, in one read; never
    blocks on a FIFO or reads a device."""
    if not within_root(path, root):
        raise AdapterPathForbidden(name, f"{path!r} resolves to {os.path.realpath(path)!r}, outside --lora-root")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise AdapterFilesError(name, f"no {os.path.basename(path)} in {os.path.dirname(path)!r}") from None
    except OSError as e:
        raise AdapterFilesError(name, f"{path!r} cannot be opened: {e.strerror or e}") from None
    with os.fdopen(fd, "rb") as f:
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise AdapterFilesError(name, f"{path!r} is not a regular file")
            if st.st_size > limit:
                raise AdapterFilesError(name, f"{path!r} holds {st.st_size} bytes; at most {limit} fit this adapter")
            data = f.read(limit + 1)
        except OSError as e:
            raise AdapterFilesError(name, f"{path!r} cannot be read: {e.strerror or e}") from None
    if len(data) > limit:
        raise AdapterFilesError(name, f"{path!r} grew past {limit} bytes while read")
    return data


def digest(*parts: bytes) -> str:
    """The files' fingerprint: a reread that differs is the adapter changed on disk."""
    h = hashlib.sha256()
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.hexdigest()
