"""LoRA adapters at run time, as vLLM's endpoints:

    POST /v1/load_lora_adapter     {"lora_name": "sql", "lora_path": "sql-v2"}
    POST /v1/unload_lora_adapter   {"lora_name": "sql"}

lora_path is not a path here: it names a subdirectory of the operator's
--lora-dir as listed there (default: lora_name), and nothing else is ever
opened (lora/manager.py read_named). Without --lora-dir the endpoints answer
400. The adapter is read and checked on a worker thread, then added on the
engine thread; an unload lets running requests finish with the adapter they
started with, and drops its cached KV.
"""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from trajserve.lora.adapter import AdapterError
from trajserve.server.errors import APIError
from trajserve.server.state import ServerState, server_state

router = APIRouter()


class LoadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(max_length=64)
    lora_path: str | None = Field(default=None, max_length=255)


class UnloadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(max_length=64)
    lora_int_id: int | None = None  # vLLM's clients may send it; names identify adapters here


def _manager(st: ServerState):
    if st.engine.lora is None:
        raise APIError(400, "this server runs no LoRA adapters (start it with --lora-dir to load them at run time)",
                       param="lora_name")
    return st.engine.lora


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(req: LoadLoRARequest, st: ServerState = Depends(server_state)):
    manager = _manager(st)
    if req.lora_name in st.names:
        raise APIError(400, f"lora_name {req.lora_name!r} is the base model's name", param="lora_name")
    param = "lora_path" if req.lora_path is not None else "lora_name"
    try:
        adapter = await asyncio.to_thread(manager.read_named, req.lora_name, req.lora_path)
        await st.aengine.call(lambda _: manager.add(adapter))
    except AdapterError as e:
        raise APIError(400, str(e), param="lora_name" if "lora_name" in str(e) else param) from None
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(req: UnloadLoRARequest, st: ServerState = Depends(server_state)):
    _manager(st)
    try:
        await st.aengine.call(lambda engine: engine.unload_lora(req.lora_name))
    except AdapterError as e:
        raise APIError(404, str(e), param="lora_name", code="model_not_found") from None
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
