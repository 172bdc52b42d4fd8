"""An agent speaking the control protocol by hand (no agent threads): tests drive each message themselves."""

from __future__ import annotations

import os
import socket
from typing import Any

from ckpt_engine.control.client import ControlClient
from ckpt_engine.errors import CkptEngineError
from tests.daemon_harness import DaemonProcess


class RawAgent:
    """Registered with the token of its role; later messages carry the session its registration returned."""

    def __init__(self, daemon: DaemonProcess, role: str, *, token: str | None = "default", **register: Any) -> None:
        self.daemon = daemon
        credential = "trainer" if role == "trainer" else "rollout"
        # (a bound on a loaded machine's reply, not a wait: a poll parks at most half a heartbeat)
        self.client = ControlClient(daemon.zmq, timeout_s=30,
                                    token=daemon.tokens()[credential] if token == "default" else token)
        body = {"role": role, "rank": 0, "host": socket.gethostname(), "pid": os.getpid(), "device": "cpu",
                **register}
        self.reply = self.client.request("register", body)
        self.agent_id, self.session = self.reply["agent_id"], self.reply["session"]

    @property
    def identity(self) -> dict[str, str]:
        return {"agent_id": self.agent_id, "session": self.session}

    def poll(self, wait_s: float = 0.0, **body: Any) -> dict | None:
        return self.client.request("poll", {**self.identity, "wait_s": wait_s, **body})["assignment"]

    def report(self, version: int, event: str, **fields: Any) -> dict:
        return self.client.request("report", {**self.identity, "version": version, "event": event, **fields})

    def request(self, kind: str, body: dict | None = None) -> dict:
        return self.client.request(kind, body or {})

    def close(self, *, unregister: bool = True) -> None:
        """Leave as an agent does (``unregister``): a version it is in ends at once, not when its heartbeat
        expires (the daemon's shutdown would wait for that); then close the connection."""
        if unregister and self.daemon.proc.poll() is None:
            try:
                self.client.request("unregister", self.identity, timeout_s=2.0)
            except CkptEngineError:  # refused (e.g. replaced meanwhile) or no answer: its heartbeat expires
                pass
        self.client.close()
