"""Hints written for other engines, mapped onto trajserve's own controls.

Two envelopes an orchestrator may already send:

  kv_hints            vLLM's typed envelope (and SGLang's, wire-compatible):
                      {protocol_version, message_id, actions: [{action_id,
                      action_type, action_version, payload}]}; the envelope
                      defines no actions, each engine implements its own.
  nvext.agent_hints   Dynamo's: priority, strict_priority, osl, speculative_prefill
  nvext.agent_context Dynamo's passive identity: session and trajectory ids
                      (or the older workflow and program ids)

What they map to (a session's pause: sessions/manager.py, through the
conversation the request belongs to: server/conversations.py):

  action retain_full_prompt {ttl_seconds}   keep the turn's state on the device for ttl_seconds
  action tool_wait {expected_wait_s, tool}  the pause's wait hint and tool, as tool_wait_s / tool
  action release                            drop the turn's state when it ends
  speculative_prefill: true                 keep the state on the device for the next turn
  agent_context trajectory_id / program_id  the conversation (a trajectory is one line of calls)
  priority                                  the request's priority (Dynamo's higher-first, negated
                                            into ours, lower first; a request's own priority wins)
  strict_priority, osl                      accepted, not applied

A request's own tool_wait_s / tool / tool_decision win over any hint.
Unknown actions are ignored and counted; a hint that needs a session
applies only to a request that is a turn of one. Counted in /metrics as
trajserve_hints_total{source, hint, outcome} (hint names from the lists
above, "unknown" for the rest: no client string becomes a label).
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from trajserve.config import PRIORITY_RANGE
from trajserve.server.conversations import KEY_MAX

ACTIONS = ("retain_full_prompt", "tool_wait", "release")
NOT_APPLIED = ("strict_priority", "osl")
SESSIONLESS = ("priority",)  # hints that apply to any request, a session's turn or not


class KvHintAction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    action_id: str = Field(max_length=256)
    action_type: str = Field(max_length=256)
    action_version: str = Field(max_length=64)
    payload: dict = {}


class KvHints(BaseModel):
    model_config = ConfigDict(extra="ignore")
    protocol_version: str = Field(max_length=64)
    message_id: str = Field(max_length=256)
    actions: list[KvHintAction] = Field(default=[], max_length=64)


class AgentHints(BaseModel):
    model_config = ConfigDict(extra="ignore")
    priority: int | None = None
    strict_priority: int | None = None
    osl: int | None = Field(default=None, ge=1)
    speculative_prefill: StrictBool | None = None


class AgentContext(BaseModel):
    model_config = ConfigDict(extra="ignore")
    session_type_id: str | None = Field(default=None, max_length=KEY_MAX)
    session_id: str | None = Field(default=None, max_length=KEY_MAX)
    trajectory_id: str | None = Field(default=None, max_length=KEY_MAX)
    parent_trajectory_id: str | None = Field(default=None, max_length=KEY_MAX)
    workflow_type_id: str | None = Field(default=None, max_length=KEY_MAX)
    workflow_id: str | None = Field(default=None, max_length=KEY_MAX)
    program_id: str | None = Field(default=None, max_length=KEY_MAX)
    parent_program_id: str | None = Field(default=None, max_length=KEY_MAX)

    def trajectory(self) -> str | None:
        """The line of calls a request continues (its conversation)."""
        return self.trajectory_id or self.program_id


class NvExt(BaseModel):
    model_config = ConfigDict(extra="ignore")
    agent_hints: AgentHints | None = None
    agent_context: AgentContext | None = None


def _number(payload: dict, key: str) -> float | None:
    v = payload.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 10**7 else None


def priority_from_hints(nvext: NvExt | None) -> int | None:
    """Dynamo's agent_hints.priority (higher first) as a trajserve priority
    (lower first), clamped into PRIORITY_RANGE; None without one."""
    hinted = nvext.agent_hints.priority if nvext is not None and nvext.agent_hints is not None else None
    if hinted is None:
        return None
    lo, hi = PRIORITY_RANGE
    return max(lo, min(hi, -hinted))


def pause_from_hints(kv_hints: KvHints | None, nvext: NvExt | None) -> tuple[dict, list[tuple[str, str, str]]]:
    """The pause the hints ask for ({"wait", "tool", "decision"}, any of
    them) and what was read: (source, hint, outcome) with outcome applied
    (if the request is a session's turn), not_applied or unknown."""
    pause: dict = {}
    seen: list[tuple[str, str, str]] = []
    for a in kv_hints.actions if kv_hints is not None else ():
        p = a.payload
        if a.action_type == "retain_full_prompt" and _number(p, "ttl_seconds") is not None:
            pause.update(decision="keep", wait=_number(p, "ttl_seconds"))
        elif a.action_type == "tool_wait" and _number(p, "expected_wait_s") is not None:
            pause["wait"] = _number(p, "expected_wait_s")
            if isinstance(p.get("tool"), str) and 0 < len(p["tool"]) <= 128:
                pause["tool"] = p["tool"]
        elif a.action_type == "release":
            pause["decision"] = "drop"
        else:
            seen.append(("kv_hints", "unknown", "unknown"))
            continue
        seen.append(("kv_hints", a.action_type, "applied"))
    hints = nvext.agent_hints if nvext is not None else None
    if hints is not None:
        for name in NOT_APPLIED:
            if getattr(hints, name) is not None:
                seen.append(("agent_hints", name, "not_applied"))
        if hints.priority is not None:
            seen.append(("agent_hints", "priority", "applied"))
        if hints.speculative_prefill:
            pause.setdefault("decision", "keep")
            seen.append(("agent_hints", "speculative_prefill", "applied"))
    return pause, seen
