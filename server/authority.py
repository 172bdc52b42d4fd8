"""Who may do what on the control planes. A token grants roles (see ckpt_engine/control/auth.py); an operation
names the roles it needs. ``auth.open`` grants every role to everyone, for development only."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable

from ckpt_engine.config import EngineConfig
from ckpt_engine.control.auth import ANY_ROLE, ROLES, Credentials, Role, credentials_path, daemon_credentials
from ckpt_engine.server.errors import Forbidden, Unauthorized

log = logging.getLogger(__name__)


class Authority:
    def __init__(self, config: EngineConfig) -> None:
        auth = config.auth
        self.open = auth.open
        self.credentials: Credentials | None = None
        self.credentials_file = credentials_path(auth.credentials_file)
        if self.open:
            log.warning("WARNING: auth.open is set: no authentication; anyone who reaches the control ports is "
                        "operator, trainer and rollout")
            return
        self.credentials = daemon_credentials(self.credentials_file, configured_tokens(config))  # type: ignore[arg-type]
        if config.auth_token is not None:
            shared = [role for role in ROLES if self.credentials.token(role) == config.auth_token]
            if len(shared) > 1:
                log.warning("WARNING: auth_token is one token for the roles %s: a host that holds it can act as any "
                            "of them. Give each role its own token (auth.operator_token, auth.trainer_token, "
                            "auth.rollout_token).", ", ".join(shared))

    def engine_secret(self) -> bytes | None:
        """What engines' worker keys derive from: the operator's token, which is never given to rollout hosts,
        so a key stays valid across restarts. None when there is no token (auth.open): a key per run."""
        token = self.credentials.token("operator") if self.credentials is not None else None
        return hashlib.sha256(f"ckpt-engine/engine-keys|{token}".encode()).digest() if token else None

    def roles_of(self, token: object) -> set[Role]:
        if self.open:
            return set(ANY_ROLE)
        if not isinstance(token, str) or self.credentials is None:
            return set()
        return self.credentials.roles_of(token)

    def require(self, token: object, allowed: Iterable[Role], what: str) -> set[Role]:
        """The token's roles, if one of them is allowed to do ``what``. Raises Unauthorized for no valid token,
        and Forbidden for a valid token of another role."""
        roles = self.roles_of(token)
        if not roles:
            raise Unauthorized("a valid token is required")
        allowed = set(allowed)
        if not roles & allowed:
            raise Forbidden(f"{what} needs a token of role {' or '.join(sorted(allowed))}; this one is "
                            f"{', '.join(sorted(roles))}")
        return roles


def configured_tokens(config: EngineConfig) -> dict[str, str | None]:
    """Each role's token as the deployment gives it; None where it is kept in, or generated into, the
    credentials file."""
    auth = config.auth
    return {"operator": auth.operator_token or config.auth_token, "trainer": auth.trainer_token or config.auth_token,
            "rollout": auth.rollout_token or config.auth_token}
