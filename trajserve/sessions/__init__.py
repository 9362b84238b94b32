"""Agent sessions: a token history that lives across turns and tool pauses,
and where its KV state waits while a tool runs (kv-cache-management
section 6: keep, offload or recompute by the break-even wait).

    manager.py        sessions themselves: ids, turns, histories, forks, expiry,
                      the engine-step hooks (SessionManager, Session)
    pause_machine.py  where a paused state waits and when it moves (the engine's
                      and the simulator's one machine)
    keep_policy.py    the decision: keep / host / disk / drop, T*_wait
    wait_estimator.py how long a tool will keep the session paused
    offload.py        the engine's transfers: real copies to the host and disk tiers
    host.py           EngineHost: everything of the engine this package uses
    ids.py            a client's session id, checked

Holding blocks has one vocabulary, defined in docs/architecture.md ("Agent
sessions and KV tiers"): pin, keep (with its lease), hold, lock.
"""
