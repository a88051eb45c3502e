"""Runs deploy/argocd/health.lua the way Argo CD does: Lua 5.1 (gopher-lua implements 5.1),
the live object as the global `obj`, only the base, string, table and math libraries, and
the returned table read as {status, message}. The interpreter is real Lua, embedded by lupa.
"""

from __future__ import annotations

from pathlib import Path

HEALTH_LUA = Path(__file__).resolve().parents[2] / "deploy" / "argocd" / "health.lua"

_SANDBOX = """
local source, obj = ...
local chunk = assert(loadstring(source, "=health.lua"))
setfenv(chunk, {
  obj = obj, string = string, table = table, math = math,
  pairs = pairs, ipairs = ipairs, next = next, type = type, select = select,
  tostring = tostring, tonumber = tonumber, pcall = pcall, error = error, unpack = unpack,
})
return chunk()
"""


def health(obj: dict, source: str | None = None) -> dict:
    from lupa.lua51 import LuaRuntime

    lua = LuaRuntime()
    run = lua.eval("function(...) " + _SANDBOX + " end")
    table = lua.table_from(obj, recursive=True)
    result = run(source if source is not None else HEALTH_LUA.read_text(), table)
    return {key: value for key, value in result.items()}
