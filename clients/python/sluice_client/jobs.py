"""What the client knows of the API's jobs: the states a job ends in, and how many jobs one wait
may name. The server holds the same facts in `sluice.wire.jobs`; the two are one contract written
twice, and tests/unit/test_client_contract.py keeps them equal."""

from __future__ import annotations

# A job in one of these states never changes again, so waiting on it is over.
FINAL = frozenset({"succeeded", "failed", "expired", "cancelled"})

# The most job ids one `GET /v1/jobs?ids=` names; the API refuses more (422).
MAX_WAIT_IDS = 256
