"""The payment aggregator: client (protocol, shared tokens, pacing) and simulator."""

from payment_worker.gateway.client import GatewayClient
from payment_worker.gateway.outcomes import GatewayResult, Outcome

__all__ = ["GatewayClient", "GatewayResult", "Outcome"]
