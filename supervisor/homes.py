"""A session's home seeded from the operator's template.

A session's HERMES_HOME starts as a copy of `template_home`, made when the
home is still empty, with the placeholders {session}, {platform},
{chat_id} and {user_id} in its text files replaced by the session's own
values (so a memory provider's session or peer name in the template's
config is each session's own).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
from collections.abc import Mapping
from pathlib import Path

PLACEHOLDERS = ("session", "platform", "chat_id", "user_id")
# Template files larger than this are copied as they are, never read whole.
MAX_TEMPLATE_TEXT = 1024 * 1024
# What a value may hold as it is; anything else is %XX-encoded, so that no
# value can end a quoted string or start a new line in the file it lands
# in (a chat id from a front end must not add keys to a config.yaml).
_SAFE_VALUE = re.compile(r"[A-Za-z0-9._:@+=-]")


def placeholder_values(key: str, session_env: Mapping[str, str]) -> dict[str, str]:
    """The values of a session's placeholders: its key, and platform,
    chat_id, user_id from its session_env (as HERMES_SESSION_* gets them).
    One it lacks falls back to something never shared with another
    session: chat_id to the part of the key after `platform:` (or the
    whole key), user_id to the key; platform to the key's `platform:` part,
    else `api` (Hermes's own default)."""
    platform_part, sep, rest = key.partition(":")
    values = {
        "session": key,
        "platform": session_env.get("PLATFORM") or (platform_part if sep else "api"),
        "chat_id": session_env.get("CHAT_ID") or (rest if sep and rest else key),
        "user_id": session_env.get("USER_ID") or key,
    }
    return {name: safe_value(value) for name, value in values.items()}


def safe_value(value: str) -> str:
    """`value` with every character outside letters, digits and `._:@+=-`
    written as %XX (its UTF-8 bytes), like a URL."""
    return "".join(
        ch if _SAFE_VALUE.fullmatch(ch) else "".join(f"%{b:02X}" for b in ch.encode())
        for ch in value
    )


def home_is_empty(home: Path) -> bool:
    """Whether a home has nothing in it yet (or is not there): the only
    home a template is copied into, so a session's own is never overwritten."""
    try:
        with os.scandir(home) as entries:
            return next(entries, None) is None
    except FileNotFoundError:
        return True
    except NotADirectoryError:
        return False


def seed_home(template: Path, home: Path, values: Mapping[str, str]) -> int:
    """Copy `template` into `home`, replacing {session}, {platform},
    {chat_id} and {user_id} in its text files (UTF-8 without NUL, up to
    MAX_TEMPLATE_TEXT); symlinks stay symlinks. The number of files in
    which a placeholder was replaced. Runs in a thread."""
    replaced = 0
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    for root, dirs, files in os.walk(template):
        rel = Path(root).relative_to(template)
        dest_dir = home / rel
        for name in dirs:
            src = Path(root) / name
            if src.is_symlink():
                os.symlink(os.readlink(src), dest_dir / name)
            else:
                (dest_dir / name).mkdir(mode=0o700, exist_ok=True)
        dirs[:] = [d for d in dirs if not (Path(root) / d).is_symlink()]
        for name in files:
            src, dest = Path(root) / name, dest_dir / name
            if src.is_symlink():
                os.symlink(os.readlink(src), dest)
                continue
            if _copy_with_values(src, dest, values):
                replaced += 1
    return replaced


def _copy_with_values(src: Path, dest: Path, values: Mapping[str, str]) -> bool:
    """Copy one file; True if placeholders were replaced in it."""
    info = src.stat()
    if stat.S_ISREG(info.st_mode) and info.st_size <= MAX_TEMPLATE_TEXT:
        data = src.read_bytes()
        if b"{" in data and b"\0" not in data:
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                text = None
            if text is not None:
                new = text
                for name, value in values.items():
                    new = new.replace("{" + name + "}", value)
                if new != text:
                    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                    with os.fdopen(fd, "w", encoding="utf-8") as f:
                        f.write(new)
                    os.chmod(dest, stat.S_IMODE(info.st_mode) & 0o700 | 0o600)
                    return True
    try:
        shutil.copy2(src, dest)
    except OSError as exc:
        if exc.errno != errno.EEXIST:
            raise
    return False
