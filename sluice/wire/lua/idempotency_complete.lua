-- idempotency_complete.lua: complete an Idempotency-Key with the ids of the jobs its request
-- wrote, if it is still that request's claim (`sluice.wire.idempotency`).
--
-- KEYS[1]: the key's record
--
-- ARGV[1]: the in-progress marker the caller set
-- ARGV[2]: the completed record
-- ARGV[3]: its TTL (s)
--
-- Returns: 1 if it completed the key, else 0.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3])
return 1
