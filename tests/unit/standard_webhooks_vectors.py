"""The Standard Webhooks specification's published test vectors, written out here (no network).

From the reference libraries' tests (github.com/standard-webhooks/standard-webhooks,
`libraries/python/tests/test_webhooks.py`, `test_sign_function` and the verification cases): the
vector secret, message id, timestamp and payload, the signature they give, a signature one
character off, and the multi-signature header in which one valid entry hides among a `v2` one and
strangers. The verification cases use a five-minute tolerance either way.
"""

from __future__ import annotations

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
MSG_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
TIMESTAMP = 1614265330
PAYLOAD = b'{"test": 2432232314}'
SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
BAD_SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OA="
TOLERANCE_S = 300
STRANGER = "Ceo5qEr07ixe2NLpvHk3FH9bwy/WavXrAFQ/9tdO6mc="
MULTI_SIGNATURE = " ".join([f"v1,{STRANGER}", f"v2,{STRANGER}", SIGNATURE, f"v1,{STRANGER}"])
