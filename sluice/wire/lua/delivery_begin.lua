-- delivery_begin.lua: start one attempt at a webhook delivery (workers/delivery.py), within its
-- tenant's share of the delivery pool and its tenant's delivery rate.
--
-- KEYS[1]: the delivery's hash (`sluice.wire.keys.delivery`)
-- KEYS[2]: the due set (`sluice.wire.keys.WEBHOOK_DUE`, the same slot)
-- KEYS[3]: the tenant's attempts in flight (`sluice.wire.keys.webhook_tenant_slots`, the same slot)
-- KEYS[4]: the tenant's rate state (`sluice.wire.keys.webhook_tenant_rate`, the same slot)
--
-- ARGV[1]: now
-- ARGV[2]: the job id
-- ARGV[3]: the lease token
-- ARGV[4]: lease_s
-- ARGV[5]: max_attempts
-- ARGV[6]: ttl_s of the delivery's hash
-- ARGV[7]: the delivery id
-- ARGV[8]: the early slack (s): how long before its due time a retry message still counts
-- ARGV[9]: the tenant's attempts in flight at most (0: no tenant, no admission: the attempt only
--          records that the delivery cannot be made)
-- ARGV[10]: the tenant's attempts per second
-- ARGV[11]: the tenant's burst (attempts)
-- ARGV[12]: seconds to defer an attempt when the tenant's share is in use (the caller's jitter)
--
-- Returns: {'go', attempt number}; {'deferred', seconds} (the tenant is over its share or its
-- rate: the attempt is not counted, the delivery is due again then); or why not: {'delivered'} or
-- {'failed'} (the delivery is done), {'busy'} (another copy of the task holds its lease),
-- {'early'} (its next attempt is not due: a duplicate message).
--
-- The attempt is counted before it is made, so duplicates and dead workers can never add attempts
-- beyond max_attempts. The rate is a token bucket kept as GCRA's one number, the theoretical
-- arrival time: an attempt over the rate reserves the next free turn (`rate_at` on the delivery),
-- so deferred attempts come back one turn apart instead of all at once, and pass when they do.
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
local lease_s = tonumber(ARGV[4])
local share = tonumber(ARGV[9])
if share > 0 then
  local wait = nil
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  if redis.call('ZCARD', KEYS[3]) >= share then
    wait = tonumber(ARGV[12])
  elseif not redis.call('HGET', KEYS[1], 'rate_at') then
    local interval = 1 / tonumber(ARGV[10])
    local tat = math.max(tonumber(redis.call('GET', KEYS[4]) or '0'), now) + interval
    redis.call('SET', KEYS[4], tostring(tat), 'PX', math.ceil((tat - now) * 1000) + 1000)
    local over = tat - now - tonumber(ARGV[11]) * interval
    -- A millisecond of slack: times are floats, and stored with 14 significant digits.
    if over > 0.001 then
      wait = over
      redis.call('HSET', KEYS[1], 'rate_at', tostring(now + over))
    end
  end
  if wait then
    redis.call('HSET', KEYS[1], 'job', ARGV[2], 'status', 'deferred', 'next_at', tostring(now + wait),
      'updated_at', ARGV[1])
    redis.call('EXPIRE', KEYS[1], tonumber(ARGV[6]))
    redis.call('ZADD', KEYS[2], now + wait, ARGV[7])
    return {'deferred', tostring(wait)}
  end
  redis.call('ZADD', KEYS[3], now + lease_s, ARGV[3])
  redis.call('PEXPIRE', KEYS[3], math.ceil(lease_s * 1000))
  redis.call('HDEL', KEYS[1], 'rate_at')
end
local lease_until = now + lease_s
redis.call('HSET', KEYS[1], 'job', ARGV[2], 'status', 'sending', 'attempts', attempts + 1, 'lease', ARGV[3],
  'lease_until', tostring(lease_until), 'updated_at', ARGV[1])
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[6]))
redis.call('ZADD', KEYS[2], lease_until, ARGV[7])
return {'go', tostring(attempts + 1)}
