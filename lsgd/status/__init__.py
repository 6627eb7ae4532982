"""Watching a job: node 0's status page (HTTP), its dashboard, and ``lsgd status``.

The global server serves ``/status.json``, ``/history.json``, ``/metrics`` and the dashboard
``/`` on ``STATUS_PORT``. With a job secret every endpoint needs a token derived from it
(``status_token``): the secret itself never travels, and the token cannot sign gRPC calls.
"""

from __future__ import annotations

import hashlib
import hmac

TOKEN_CONTEXT = b"lsgd status page v1"


def status_token(secret: bytes) -> str:
    """The bearer token of a job's status page: an HMAC of a fixed context under the secret."""
    return hmac.new(secret, TOKEN_CONTEXT, hashlib.sha256).hexdigest()[:32]
