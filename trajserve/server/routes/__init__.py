"""The HTTP API, one router per API over the injected ServerState (server/state.py)."""
