"""The registration rule (server/decisions/claims.py) as a table: what a registrant may claim about membership given
the agents registered now. Pure: no daemon, no clock (the time is an argument)."""

from __future__ import annotations

import itertools

import pytest

from ckpt_engine.control.messages import Register
from ckpt_engine.server.decisions.agent_record import AgentRecord
from ckpt_engine.server.decisions.claims import judge_registration

HEARTBEAT_S = 10.0
NOW = 1000.0
_ids = itertools.count()


def agent(role: str, *, rank: int = 0, engine: str | None = None, driven: bool = False, members: int | None = None,
          trainer_ranks: int = 1, framework: str | None = None, silent_s: float = 0.0) -> AgentRecord:
    n = next(_ids)
    return AgentRecord(f"a{n}", "s" * 48, n, role, rank, "host", 100 + n, "cpu", None, 0.0, NOW - silent_s,
                 engine=engine, driven=driven, members=members, trainer_ranks=trainer_ranks, framework=framework,
                 poll_wait_s=1.0)


def register(role: str, **fields) -> Register:
    return Register(role=role, host="h", pid=1, device="cpu", **fields)


SILENT = 8.0  # past the silence window (poll wait 1 s + half a heartbeat), before the heartbeat expires
CASES = [
    # (name, registered agents, registration, refused?, replaced (indices into the agents))
    ("first trainer", [], register("trainer", trainer_ranks=2), False, []),
    ("second job's rank 0 while the first is alive", [agent("trainer", trainer_ranks=2)],
     register("trainer", trainer_ranks=2), True, []),
    ("restarted job's rank 0 once the old one is silent", [agent("trainer", trainer_ranks=2, silent_s=SILENT)],
     register("trainer", trainer_ranks=2), False, [0]),
    ("a live rank 1 is not replaced", [agent("trainer", trainer_ranks=2), agent("trainer", rank=1)],
     register("trainer", rank=1), True, []),
    ("a rank beyond the job's ranks", [agent("trainer", trainer_ranks=2)], register("trainer", rank=2), True, []),
    ("a plain rank 1 beside a verl job", [agent("trainer", trainer_ranks=2, framework="verl")],
     register("trainer", rank=1), True, []),
    ("a verl rank 0 while a plain trainer is alive", [agent("trainer")],
     register("trainer", framework="verl", trainer_ranks=1), True, []),
    ("an engine's impostor worker", [agent("receiver", engine="eng", driven=True, members=1),
                                     agent("driver", engine="eng", members=1)],
     register("receiver", engine="eng", driven=True, members=1), True, []),
    ("a worker claiming another member count", [agent("receiver", engine="eng", driven=True, members=2),
                                               agent("driver", engine="eng", members=2)],
     register("receiver", engine="eng", driven=True, members=3), True, []),
    ("the second of two workers", [agent("receiver", engine="eng", driven=True, members=2),
                                   agent("driver", engine="eng", members=2)],
     register("receiver", engine="eng", driven=True, members=2), False, []),
    ("a restarted worker replaces its silent old self",
     [agent("receiver", engine="eng", driven=True, members=1, silent_s=SILENT),
      agent("driver", engine="eng", members=1)],
     register("receiver", engine="eng", driven=True, members=1), False, [0]),
    ("a receiver naming a driven engine without being driven",
     [agent("receiver", engine="eng", driven=True, members=1), agent("driver", engine="eng", members=1)],
     register("receiver", engine="eng"), True, []),
    ("a driven worker of an engine whose receivers are not driven", [agent("receiver", engine="eng")],
     register("receiver", engine="eng", driven=True, members=1), True, []),
    ("a second driver", [agent("driver", engine="eng", members=1)], register("driver", engine="eng", members=1),
     True, []),
    ("a driver replacing a silent one", [agent("driver", engine="eng", members=1, silent_s=SILENT)],
     register("driver", engine="eng", members=1), False, [0]),
    ("a driver claiming another member count", [agent("receiver", engine="eng", driven=True, members=2)],
     register("driver", engine="eng", members=1), True, []),
    ("plain receivers are many", [agent("receiver"), agent("receiver")], register("receiver"), False, []),
    ("a driver that does not say how many workers", [agent("receiver", engine="eng", driven=True, members=2)],
     register("driver", engine="eng"), False, []),
    ("a worker of an engine whose driver does not say", [agent("driver", engine="eng")],
     register("receiver", engine="eng", driven=True, members=2), False, []),
]


@pytest.mark.parametrize(("name", "agents", "message", "refused", "replaced"), CASES, ids=[c[0] for c in CASES])
def test_registration_claims(name: str, agents: list[AgentRecord], message: Register, refused: bool,
                             replaced: list[int]) -> None:
    verdict = judge_registration(message, agents, NOW, HEARTBEAT_S)
    assert (verdict.conflict is not None) == refused, verdict
    assert verdict.replaces == tuple(agents[i].agent_id for i in replaced)
    if refused:
        assert verdict.live_agent in {a.agent_id for a in agents}  # the conflict names who holds the place
        assert verdict.live_agent in verdict.conflict


def test_a_refusal_says_when_a_falling_silent_holder_could_be_replaced() -> None:
    holder = agent("trainer", silent_s=2.0)
    verdict = judge_registration(register("trainer"), [holder], NOW, HEARTBEAT_S)
    assert verdict.retry_after_s == pytest.approx(1.0 + HEARTBEAT_S / 2 - 2.0)
    assert "in 4.0s at the earliest" in verdict.conflict


@pytest.mark.parametrize(("register_wait_s", "first_answer_s", "waits_s"), [
    (30.0, 1.5, 30.0),  # a default heartbeat: the fixed wait covers it
    (30.0, 31.0, 67.0),  # heartbeat_s 60: the old one is replaced only after 31 s (found by the outside attack)
    (30.0, 1e9, 7205.0),  # bounded: a live holder keeps pushing its answer back
])
def test_a_restarted_agent_waits_as_long_as_the_daemon_says(register_wait_s, first_answer_s, waits_s) -> None:
    from ckpt_engine.workers.agent import registration_wait

    assert registration_wait(register_wait_s, first_answer_s) == waits_s
