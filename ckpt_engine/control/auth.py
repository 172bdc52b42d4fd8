"""Credentials: one token per role, so a rollout host's token cannot act as the trainer or the operator.

- ``operator``: HTTP and ZMQ commands that change state (sync, push, evict) and every read.
- ``trainer``: registering trainer agents, and requesting syncs from the training loop (``agent.push``).
- ``rollout``: registering receivers and engine drivers.

Whoever holds a role's token can register an agent of that role; every later message of that agent must
carry the session secret its registration returned, so one agent cannot speak for another.

The daemon writes the tokens it uses to a credentials file readable only by its own user (mode 0600).
Tokens the configuration does not fix are generated once and kept in that file, so they survive restarts
and agents on the same host and user find them without configuration.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ckpt_engine.errors import ConfigError

Role = Literal["operator", "trainer", "rollout"]
ROLES: tuple[Role, ...] = ("operator", "trainer", "rollout")
# The token an agent of each kind speaks with (its messages are refused under any other)
TOKEN_OF_AGENT: dict[str, Role] = {"trainer": "trainer", "receiver": "rollout", "driver": "rollout"}
ANY_ROLE: frozenset[Role] = frozenset(ROLES)  # an operation any valid token may call
DEFAULT_CREDENTIALS_FILE = "~/.ckpt-engine/credentials.json"
CREDENTIALS_ENV = "CKPT_ENGINE_CREDENTIALS"
TOKEN_ENV = "CKPT_ENGINE_TOKEN"
TOKEN_PATTERN = r"^[\x21-\x7e]+$"  # visible ASCII: tokens travel in an HTTP header
# The one limit of a token's length: the config, the credentials file, the wire (Register) and the docs use it.
TOKEN_MIN_LENGTH, TOKEN_MAX_LENGTH = 16, 4096
Token = Annotated[str, Field(min_length=TOKEN_MIN_LENGTH, max_length=TOKEN_MAX_LENGTH, pattern=TOKEN_PATTERN)]
_MAX_FILE_BYTES = 64 << 10

log = logging.getLogger(__name__)


class Credentials(BaseModel):
    """The token of each role (None: that role cannot act)."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    operator: Token | None = None
    trainer: Token | None = None
    rollout: Token | None = None

    def token(self, role: Role) -> str | None:
        return getattr(self, role)

    def roles_of(self, token: str) -> set[Role]:
        """The roles ``token`` grants (more than one only when a deployment gives roles one token)."""
        import hmac

        given = token.encode(errors="surrogatepass")
        # compare_digest: the time taken does not tell how much of a guessed token was right
        return {role for role in ROLES if (mine := self.token(role)) is not None
                and hmac.compare_digest(given, mine.encode())}


TOKEN_PREFIX = "cke_"


def new_token() -> str:
    # the prefix keeps a token from starting with "-" (1 in 64 urlsafe tokens did): `--token -x...` is an
    # unknown option to every command line that takes it
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def credentials_path(configured: str | None = None) -> Path:
    """Where credentials live: the given path, else ``$CKPT_ENGINE_CREDENTIALS``, else the default."""
    raw = configured or os.environ.get(CREDENTIALS_ENV) or DEFAULT_CREDENTIALS_FILE
    return Path(raw).expanduser()


def read_credentials(path: Path) -> Credentials | None:
    """The credentials in ``path``, or None when it does not exist. A file other users can read, or one owned
    by another user, is refused: anyone able to change it could become the trainer."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"credentials file {path}: cannot open: {exc.strerror}") from exc
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):  # (before fdopen, which refuses a directory with its own error)
        os.close(fd)
        raise ConfigError(f"credentials file {path}: not a regular file")
    with os.fdopen(fd, "rb") as handle:
        if info.st_uid != os.getuid():
            raise ConfigError(f"credentials file {path}: owned by uid {info.st_uid}, not by this user")
        if info.st_mode & 0o077:
            raise ConfigError(f"credentials file {path}: mode {stat.S_IMODE(info.st_mode):o} lets other users "
                              "read it; chmod 600 it")
        raw = handle.read(_MAX_FILE_BYTES + 1)
    if len(raw) > _MAX_FILE_BYTES:
        raise ConfigError(f"credentials file {path}: larger than {_MAX_FILE_BYTES} bytes")
    try:
        return Credentials.model_validate(json.loads(raw))
    except (ValueError, ValidationError) as exc:
        raise ConfigError(f"credentials file {path}: unreadable: {exc}") from exc


def write_credentials(path: Path, credentials: Credentials) -> None:
    """Write atomically with mode 0600 into a private directory (created 0700 when missing). The temporary
    file is made with O_EXCL under a random name (never one another user could create first, nor a link to
    follow), and a directory others can write in is refused: they could replace the file once written."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_private_directory(path.parent, path)
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump(credentials.model_dump(), handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def check_private_directory(directory: Path, path: Path) -> None:
    """Refuse (ConfigError naming ``path``) a directory that another user owns or that others can write in."""
    try:
        info = os.stat(directory)
    except OSError as exc:
        raise ConfigError(f"credentials file {path}: cannot use {directory}: {exc.strerror}") from exc
    if not stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"credentials file {path}: {directory} is not a directory")
    if info.st_uid not in (os.getuid(), 0):
        raise ConfigError(f"credentials file {path}: its directory {directory} is owned by uid {info.st_uid}, "
                          "not by this user; keep credentials in a directory of your own")
    if info.st_mode & 0o022:
        raise ConfigError(f"credentials file {path}: its directory {directory} has mode "
                          f"{stat.S_IMODE(info.st_mode):o}: other users can write in it and replace the file; "
                          "chmod go-w it or choose a private directory")


def daemon_credentials(path: Path, fixed: Mapping[Role, str | None]) -> Credentials:
    """The tokens the daemon accepts: the configured ones, then those already in the file, then new ones.
    The result is written back to the file so local clients can read it. When every token is given (e.g. from
    a Kubernetes Secret) the daemon needs nothing of the file: one it cannot keep private is then left alone
    (logged), instead of refusing to start (a kubelet's fsGroup pass makes a volume's folders group-writable)."""
    if all(fixed.get(role) for role in ROLES):
        try:
            if path.parent.exists():
                check_private_directory(path.parent, path)
        except ConfigError as exc:
            log.warning("the credentials file is not written (every role's token is configured, so the daemon "
                        "does not need it; clients take theirs from their environment): %s", exc)
            return Credentials(**{role: fixed[role] for role in ROLES})
    if path.parent.exists():  # also when the file is there already: others could replace it at any time
        check_private_directory(path.parent, path)
    existing = read_credentials(path) or Credentials()
    tokens = {role: fixed.get(role) or existing.token(role) or new_token() for role in ROLES}
    credentials = Credentials(**tokens)
    if credentials != existing:
        try:
            write_credentials(path, credentials)
        except OSError as exc:
            raise ConfigError(f"auth.credentials_file: cannot write {path}: {exc.strerror}") from exc
    return credentials


def check_credentials_path(path: Path) -> None:
    """What ``serve`` would refuse about the credentials file, found without writing it (ConfigError)."""
    if path.parent.exists():  # the daemon writes the file there (again, when tokens change)
        check_private_directory(path.parent, path)
    if read_credentials(path) is not None:  # it exists: mode, owner, type and contents are checked
        return
    parent = next((p for p in [path.parent, *path.parent.parents] if p.exists()), Path("/"))
    if not parent.is_dir():
        raise ConfigError(f"auth.credentials_file: {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"auth.credentials_file: {path}: cannot create files in {parent}")


def client_token(role: Role, explicit: str | None = None, path: str | None = None) -> str | None:
    """The token a client of ``role`` sends: the one given, else ``$CKPT_ENGINE_TOKEN``, else the role's entry
    of the credentials file (when this user can read one), else None."""
    if explicit:
        return explicit
    from_env = os.environ.get(TOKEN_ENV)
    if from_env:
        return from_env
    found = read_credentials(credentials_path(path))
    return found.token(role) if found is not None else None
