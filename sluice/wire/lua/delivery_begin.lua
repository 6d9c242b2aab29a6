-- delivery_begin.lua: start one attempt at a webhook delivery (workers/delivery.py).
--
-- KEYS[1]: the delivery's hash (`sluice.wire.keys.delivery`)
-- KEYS[2]: the due set (`sluice.wire.keys.WEBHOOK_DUE`, the same slot)
--
-- ARGV[1]: now
-- ARGV[2]: the job id
-- ARGV[3]: the lease token
-- ARGV[4]: lease_s
-- ARGV[5]: max_attempts
-- ARGV[6]: ttl_s of the delivery's hash
-- ARGV[7]: the delivery id
-- ARGV[8]: the early slack (s): how long before its due time a retry message still counts
--
-- Returns: {'go', attempt number}, or why not: {'delivered'} or {'failed'} (the delivery is
-- done), {'busy'} (another copy of the task holds its lease), {'early'} (its next attempt is not
-- due: a duplicate message).
--
-- The attempt is counted before it is made, so duplicates and dead workers can never add attempts
-- beyond max_attempts.
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'delivered' or status == 'failed' then return {status} end
local now = tonumber(ARGV[1])
if tonumber(redis.call('HGET', KEYS[1], 'lease_until') or '0') > now then return {'busy'} end
if tonumber(redis.call('HGET', KEYS[1], 'next_at') or '0') > now + tonumber(ARGV[8]) then return {'early'} end
local attempts = tonumber(redis.call('HGET', KEYS[1], 'attempts') or '0')
if attempts >= tonumber(ARGV[5]) then
  redis.call('HSET', KEYS[1], 'status', 'failed', 'updated_at', ARGV[1])
  redis.call('ZREM', KEYS[2], ARGV[7])
  return {'failed'}
end
local lease_until = now + tonumber(ARGV[4])
redis.call('HSET', KEYS[1], 'job', ARGV[2], 'status', 'sending', 'attempts', attempts + 1, 'lease', ARGV[3],
  'lease_until', tostring(lease_until), 'updated_at', ARGV[1])
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[6]))
redis.call('ZADD', KEYS[2], lease_until, ARGV[7])
return {'go', tostring(attempts + 1)}
