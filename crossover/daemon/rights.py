"""Who may call what: decided by where a call arrives, before any handler runs.

One gRPC server per way in, each with its `Gate`:
- the rank socket (0660): ranks and readers; the admin calls that change state
  (`ADMIN_CALLS`) are refused with PERMISSION_DENIED (`rank_socket_rule`);
- the admin socket beside it (0600, or 0660 for --admin-group): every call, no gate;
- TCP: every call needs the shared token, the admin calls the admin token
  (none without --admin-token-file); tokens are compared in constant time (`tcp_rule`).
"""
from __future__ import annotations

import hmac
from typing import Any, Callable, Optional

import grpc

from crossover.daemon import rpc_errors
from crossover.protos import STEERING_CALLS, TOKEN_METADATA_KEY

__all__ = ["ADMIN_CALLS", "Gate", "Refusal", "Rule", "rank_socket_rule", "tcp_rule"]

ADMIN_CALLS = frozenset(f"/crossover.v1.Admin/{name}" for name in STEERING_CALLS)

Refusal = tuple[grpc.StatusCode, str]  # how a call is refused
Rule = Callable[[str, dict], Optional[Refusal]]  # (method, metadata) -> a refusal, or None: the call goes on


class Gate(grpc.aio.ServerInterceptor):
    """Refuses the calls its rule refuses before any handler runs (a server's only way in).

    The refusal is a handler of the call's own shape that aborts, so a refused
    call reaches no service code at all.
    """

    def __init__(self, rule: Rule) -> None:
        self._rule = rule

    async def intercept_service(self, continuation: Callable[..., Any], details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        refusal = None if handler is None else self._rule(details.method, dict(details.invocation_metadata or ()))
        if refusal is None:
            return handler
        code, message = refusal
        rpc_errors.count(code)

        async def refuse(_request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(code, message)

        shape = {(False, False): grpc.unary_unary_rpc_method_handler,
                 (False, True): grpc.unary_stream_rpc_method_handler,
                 (True, False): grpc.stream_unary_rpc_method_handler,
                 (True, True): grpc.stream_stream_rpc_method_handler}
        make = shape[(handler.request_streaming, handler.response_streaming)]
        return make(refuse, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)


def rank_socket_rule(admin_socket: str | None) -> Rule:
    """The rank socket's rule: every call but the admin calls."""
    where = f"the admin socket {admin_socket}" if admin_socket else "no admin socket here"

    def rule(method: str, _metadata: dict) -> Refusal | None:
        if method in ADMIN_CALLS:
            return (grpc.StatusCode.PERMISSION_DENIED,
                    f"{method.rsplit('/', 1)[-1]} is an admin call; this daemon takes it on {where} "
                    "(`crossover` uses it by itself)")
        return None

    return rule


def tcp_rule(token: str, admin_token: str | None) -> Rule:
    """TCP's rule: the token for every call, the admin token for the admin calls."""
    rank_key, admin_key = token.encode(), admin_token.encode() if admin_token else None

    def rule(method: str, metadata: dict) -> Refusal | None:
        given = str(metadata.get(TOKEN_METADATA_KEY, "")).encode()
        is_admin = admin_key is not None and hmac.compare_digest(given, admin_key)
        if not is_admin and not hmac.compare_digest(given, rank_key):
            return grpc.StatusCode.UNAUTHENTICATED, f"missing or wrong {TOKEN_METADATA_KEY} metadata"
        if method in ADMIN_CALLS and not is_admin:
            why = "the admin token" if admin_key else "an admin token, and this daemon has none (--admin-token-file)"
            return grpc.StatusCode.PERMISSION_DENIED, f"{method.rsplit('/', 1)[-1]} over TCP needs {why}"
        return None

    return rule
