"""The payment aggregator: the client (protocol, shared tokens, pacing) and its answer classes.

Names are resolved on first use, so importing the pure answer table
(``payment_worker.gateway.outcomes``) does not import the client and its clients.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from payment_worker.gateway.client import GatewayClient
    from payment_worker.gateway.outcomes import GatewayResult, Outcome

__all__ = ["GatewayClient", "GatewayResult", "Outcome"]


def __getattr__(name: str) -> Any:
    if name == "GatewayClient":
        from payment_worker.gateway.client import GatewayClient

        return GatewayClient
    if name in ("GatewayResult", "Outcome"):
        from payment_worker.gateway import outcomes

        return getattr(outcomes, name)
    raise AttributeError(name)
