"""Custom ops dhelix's rewritten graphs call; importing this package registers them with torch.

exchange.py   ``dhelix::exchange``: a send and a receive in one asynchronous, functional op
"""

from dhelix_compile.ops.exchange import P2P_EXCHANGE, p2p_exchange

__all__ = ["P2P_EXCHANGE", "p2p_exchange"]
