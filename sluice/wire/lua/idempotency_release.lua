-- idempotency_release.lua: release an Idempotency-Key whose request failed, if it is still that
-- request's claim (`sluice.wire.idempotency`).
--
-- KEYS[1]: the key's record
--
-- ARGV[1]: the in-progress marker the caller set
--
-- Returns: 1 if it deleted the record, else 0.
--
-- Never deletes a completed record, nor another request's claim.
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
